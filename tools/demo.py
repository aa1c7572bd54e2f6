"""End to end on an embedded default: make an image folder, build a store, read it back.

    python3 tools/demo.py [--workdir DIR] [--classes 5] [--per-class 40]

The folder is cut from the real photographs bundled with the package, plus a few of the
files real datasets contain (a CMYK JPEG, a PNG named .JPEG, a truncated JPEG, an HTML
page named .jpg, a .DS_Store), so the summary shows what the converter keeps, fixes,
rejects and ignores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from ingest.build import BuildOptions, build
from ingest.cli import quiet_pipe
from ingest.verify import verify_store
from loader.bench.synth import make_image_folder


def add_real_world_mess(src: Path) -> None:
    """Five odd files in the first three class folders (fewer where there are fewer)."""
    classes = sorted(p for p in src.iterdir() if p.is_dir())
    one, two, three = (classes[min(k, len(classes) - 1)] for k in range(3))
    first = sorted(one.glob("*.JPEG"))[0]
    photo = Image.open(first)
    photo.convert("CMYK").save(one / "cmyk.jpg", quality=92)
    photo.save(two / "actually_a_png.JPEG", format="PNG")
    data = first.read_bytes()
    (two / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (three / "download.jpg").write_text("<!DOCTYPE html><html>404</html>")
    (three / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")


def read_back(store: Path, batch_size: int = 32) -> int:
    """One shuffled training epoch through loader.DataLoader, on the CPU."""
    import loader

    first, _ = loader.LMDBDataset(store)[0]
    dl = loader.DataLoader(str(store), batch_size=batch_size, shuffle=True, num_workers=2,
                           transform="train", device="cpu")  # fmt: skip
    t0, sizes = time.perf_counter(), []
    for images, labels in dl:
        sizes.append(len(labels))
        image, dtype = "x".join(map(str, images.shape[1:])), str(images.dtype).split(".")[-1]
    dl.close()
    seen, rate = sum(sizes), sum(sizes) / (time.perf_counter() - t0)
    last = f", the last of {sizes[-1]}" if sizes[-1] != batch_size else ""
    print(f"read back  {seen} samples in {len(sizes)} batch(es) of {batch_size}{last}: "
          f"{dtype} images {image}, {rate:.0f} img/s (LMDBDataset[0] is a PIL image of "
          f"{first.size[0]}x{first.size[1]})")  # fmt: skip
    return seen


FORMATS = {"jpeg baseline": "baseline JPEG", "jpeg progressive": "progressive JPEG", "png": "PNG"}
FIXES = {
    "cmyk-to-rgb": "CMYK converted to RGB",
    "ycck-to-rgb": "YCCK converted to RGB",
    "reencoded-jpeg": "re-encoded as JPEG",
    "exif-orientation": "rotated upright (EXIF)",
    "16bit-to-8bit": "16-bit reduced to 8-bit",
    "alpha-dropped": "alpha channel dropped",
    "resized-from": "shrunk to --max-size",
}


def describe_formats(stats: dict) -> tuple[str, str]:
    """The build's format counts as two lines a user can read: what is stored, what was fixed."""
    kept = [f"{n} {FORMATS[k]}" for k, n in stats.items() if k in FORMATS]
    stored = " + ".join(kept) + f" = {sum(n for k, n in stats.items() if k in FORMATS)} records"
    if stats.get("re-encoded"):
        stored += f" ({stats['re-encoded']} of them re-encoded by ingest)"
    fixes = [
        f"{n} {FIXES.get(k[4:], k[4:].replace('-', ' '))}"
        for k, n in stats.items()
        if k.startswith("fix ")
    ]
    return stored, ", ".join(fixes) or "nothing"


@quiet_pipe
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder")
    ap.add_argument("--classes", type=int, default=5)
    ap.add_argument("--per-class", type=int, default=40)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        src, store = work / "images", work / "images.lmdb"
        make_image_folder(src, args.classes, args.per_class, seed=0)
        add_real_world_mess(src)
        print(f"made       {src}: {args.classes} classes of real-photo JPEGs + 5 odd files")
        t0 = time.perf_counter()
        m = build(src, store, BuildOptions(), overwrite=True, progress=False)
        dt = time.perf_counter() - t0
        print(f"built      {store}: {m['num_samples']} samples, {len(m['shards'])} shard(s), "
              f"{m['record_bytes'] / 2**20:.1f} MiB in {dt:.1f} s")  # fmt: skip
        print(f"counts     seen {m['num_seen']} = kept {m['num_samples']} + rejected "
              f"{m['num_rejected']} + ignored {m['num_ignored']}")  # fmt: skip
        stored, fixed = describe_formats(m["stats"])
        print(f"stored     {stored}")
        print(f"fixed      {fixed}")
        for line in (store / "rejects.jsonl").read_text().splitlines():
            reject = json.loads(line)
            print(f"rejected   {reject['path']}: {reject['reason']}")
        problems = verify_store(store)
        print(f"verify     {problems or 'OK'}")
        seen = read_back(store)
        ok = not problems and seen == m["num_samples"]
        print("demo       OK" if ok else "demo       FAILED")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
