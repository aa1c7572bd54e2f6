"""The pipelines compared, each built inside its own process by ``build(name, settings)``.

Every pipeline yields ``(images, labels)`` batches on the run's device, in the run's dtype
and memory layout, with the same augmentation: what a training loop would receive. A peer
that cannot run here says why (``unavailable``) instead of failing.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass

from loader.bench.augment import deliver, loader_options, torch_transform
from loader.bench.settings import Settings

BASELINE = "torch-pil"
JPEG_TWIN = "@jpeg"  # a name's ending: ours on the JPEG store (``share_variant``)


@dataclass(frozen=True)
class Peer:
    """A peer format: its label, its class in ``loader.bench.peers.<module>`` (given the
    variant, where it has one), the package it needs and how to install that."""

    label: str
    module: str
    cls: str
    package: str
    variant: str = ""


PEERS = {
    "ffcv": Peer("FFCV Loader on a .beton of JPEG fields (RandomResizedCropRGBImageDecoder)",
                 "ffcv", "FfcvPipeline", "ffcv", "jpg"),
    "ffcv-raw": Peer("FFCV Loader on a .beton of raw pixel fields (the same decoder)",
                     "ffcv", "FfcvPipeline", "ffcv", "raw"),
    "mds": Peer("MosaicML Streaming: StreamingImageNet on MDS shards + torch DataLoader",
                "mds", "MdsPipeline", "streaming"),
    "litdata": Peer("LitData StreamingDataset on optimize()d chunks + StreamingDataLoader",
                    "litdata", "LitdataPipeline", "litdata"),
    "wds": Peer("WebDataset tar shards + WebLoader (shuffled and rebatched across workers)",
                "wds", "WdsPipeline", "webdataset"),
}  # fmt: skip
_INSTALL = {
    "ffcv": "FFCV is not installed (its build needs libturbojpeg and OpenCV headers: see "
    "docs/benchmarks.md#peers)",
    "streaming": "MosaicML Streaming is not installed (pip install 'imfeed[peers]')",
    "litdata": "LitData is not installed (pip install 'imfeed[peers]')",
    "webdataset": "WebDataset is not installed (pip install 'imfeed[peers]')",
}


@dataclass(frozen=True)
class Spec:
    """A pipeline: its name in results, a label for the table and chart, and its side."""

    name: str
    label: str
    side: str  # "baseline", "ours", "peer", or "reference" (ours on the JPEG store: @jpeg)


def specs() -> list[Spec]:
    """Every pipeline this version knows, available here or not."""
    from loader.decode import decoders, runs_in_workers

    found = [
        Spec(BASELINE, "torch DataLoader + ImageFolder (PIL)", "baseline"),
        Spec("torch-lmdb", "torch DataLoader + LMDBDataset (PIL)", "peer"),
    ]
    found += [Spec(f"loader-{d}", f"loader.DataLoader, decoder={d!r}", "ours") for d in decoders()]
    # A GPU decoder also runs with the workers decoding a share beside it, steered by
    # feedback, to show what that share does (the plain name runs the default, cpu_share=0).
    found += [
        Spec(f"loader-{d}-auto", f"loader.DataLoader, decoder={d!r}, cpu_share='auto'", "ours")
        for d in decoders()
        if not runs_in_workers(d)
    ]
    found += [
        Spec("dali-file", "DALI file reader + decoders.image + random_resized_crop", "peer"),
        Spec("dali-crop", "DALI file reader + decoders.image_random_crop", "peer"),
        Spec("dali-ram", "DALI external_source (JPEG bytes in RAM) + image_random_crop", "peer"),
    ]
    found += [Spec(name, peer.label, "peer") for name, peer in PEERS.items()]
    return found


def share_variant(name: str) -> Spec | None:
    """``loader-<GPU decoder>-<share>`` (e.g. ``loader-nvjpeg-0.2``): the workers decode that
    fixed share of every batch; any of our pipelines, or such a share, followed by
    ``-nice<N>`` (e.g. ``loader-dali-auto-nice10``): its workers run at that
    ``worker_nice``; any of those followed by ``@jpeg``: on the JPEG store beside the one
    ``--encoding`` built; None for any other name."""
    if name.endswith(JPEG_TWIN):
        base = name.removesuffix(JPEG_TWIN)
        spec = share_variant(base) or next((x for x in specs() if x.name == base), None)
        if spec is None or spec.side != "ours":
            return None
        return Spec(name, f"{spec.label}, on the store of JPEGs", "reference")
    base, nice = nice_suffix(name)
    spec = _fixed_share(base)
    if nice is None:
        return spec
    if spec is None:
        spec = next((x for x in specs() if x.name == base and x.side == "ours"), None)
    return None if spec is None else Spec(name, f"{spec.label}, worker_nice={nice}", "ours")


def _fixed_share(name: str) -> Spec | None:
    """``loader-<GPU decoder>-<share>`` for a share in (0, 1); None for any other name."""
    from loader.decode import decoders, runs_in_workers

    decoder, _, share = name.removeprefix("loader-").partition("-")
    if not name.startswith("loader-") or decoder not in decoders() or runs_in_workers(decoder):
        return None
    try:
        value = float(share)
    except ValueError:
        return None
    if not 0.0 < value < 1.0:
        return None
    return Spec(name, f"loader.DataLoader, decoder={decoder!r}, cpu_share={value}", "ours")


def nice_suffix(name: str) -> tuple[str, int | None]:
    """(``name`` without a ``-nice<N>`` ending, N) for N in 0..19 written plainly (``nice7``,
    not ``nice07``); else (``name``, None)."""
    head, sep, value = name.rpartition("-nice")
    if sep and head and value.isascii() and value.isdigit() and str(int(value)) == value:
        return (head, int(value)) if int(value) <= 19 else (name, None)
    return name, None


def unavailable(spec: Spec, s: Settings) -> str | None:
    """Why ``spec`` cannot run with these settings (checked before starting it), or None."""
    if spec.name.endswith(JPEG_TWIN):
        if s.jpeg_store is None:
            return "needs --encoding: it reads the store of JPEGs beside the one that builds"
        return unavailable(dataclasses.replace(spec, name=spec.name.removesuffix(JPEG_TWIN)), s)
    if spec.name in PEERS:
        return _peer_unavailable(PEERS[spec.name], s)
    dali = spec.name.startswith("dali-")
    if spec.name.startswith("torch-") and importlib.util.find_spec("torchvision") is None:
        return "torchvision is not installed (pip install torchvision)"
    if (dali or spec.name.startswith("loader-dali")) and not _has_dali():
        return "DALI is not installed (pip install 'imfeed[dali]')"
    if (dali or spec.name == BASELINE) and s.folder is None:
        return "needs an image folder: give --data a folder rather than a store"
    if spec.name == "dali-crop" and s.eval:
        return "same as dali-file with --eval (no random crop to decode)"
    if not dali and spec.name != BASELINE and s.store is None:
        return "needs a store"
    if spec.name.startswith("loader-") and s.device == "cpu":
        from loader.decode import delivers_to

        decoder = spec.name.removeprefix("loader-").partition("-")[0]
        if "cpu" not in delivers_to(decoder):
            return "decodes on a CUDA device, and this run delivers to the CPU"
    return None


def _peer_unavailable(peer: Peer, s: Settings) -> str | None:
    if importlib.util.find_spec(peer.package) is None:
        return _INSTALL[peer.package]
    if s.folder is None:
        return "needs an image folder: its converter reads the images (give --data a folder)"
    if peer.variant == "raw" and s.jpeg_store is None:
        return "needs --encoding raw or mixed:SHARE: the peer of ours on a store of pixels"
    return None


def _has_dali() -> bool:
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # no "nvidia" namespace at all
        return False


def build(name: str, s: Settings):
    """Pipeline ``name`` with settings ``s``: an object with ``epoch()`` and ``close()``."""
    if name.endswith(JPEG_TWIN):
        return build(name.removesuffix(JPEG_TWIN), dataclasses.replace(s, store=s.jpeg_store))
    if name == BASELINE:
        return TorchPipeline(_image_folder(s), s)
    if name == "torch-lmdb":
        from loader import LMDBDataset

        return TorchPipeline(LMDBDataset(s.store, transform=torch_transform(s)), s)
    if name.startswith("loader-"):
        name, nice = nice_suffix(name)
        decoder, _, variant = name.removeprefix("loader-").partition("-")
        share = "auto" if variant == "auto" else float(variant) if variant else 0.0
        return OurPipeline(decoder, s, cpu_share=share, nice=nice or 0)
    if name == "synthetic":
        from loader.bench.train import Synthetic

        return Synthetic(s)
    if name.startswith("dali-"):
        from loader.bench import dali

        return dali.DaliPipeline(name.removeprefix("dali-"), s)
    if name in PEERS:
        peer = PEERS[name]
        cls = getattr(importlib.import_module(f"loader.bench.peers.{peer.module}"), peer.cls)
        return cls(s, peer.variant) if peer.variant else cls(s)
    raise ValueError(f"unknown pipeline {name!r}; known: {', '.join(x.name for x in specs())}")


def _image_folder(s: Settings):
    import torchvision.datasets

    return torchvision.datasets.ImageFolder(s.folder, transform=torch_transform(s))


class TorchPipeline:
    """torch's DataLoader over a map-style Dataset (persistent workers), batches delivered."""

    def __init__(self, dataset, s: Settings) -> None:
        import torch.utils.data

        self.s = s
        self.dl = torch.utils.data.DataLoader(dataset, shuffle=True, **loader_options(s))

    def epoch(self) -> Iterator:
        for images, labels in self.dl:
            yield deliver(images, labels, self.s)

    def close(self) -> None:
        self.dl = None


class OurPipeline:
    """``loader.DataLoader`` on the store with decoder backend ``decoder``."""

    def __init__(
        self, decoder: str, s: Settings, cpu_share: float | str = 0.0, nice: int = 0
    ) -> None:
        import loader
        from loader.recipes import recognise

        # the recipe torch's pipelines run, recognised as the loader's own (read as float:
        # for uint8 output the loader leaves out the normalisation torch's recipe lacks)
        as_float = dataclasses.replace(s, dtype="float32")
        recipe = "eval" if s.eval else recognise(torch_transform(as_float))
        self.dl = loader.DataLoader(
            s.store,
            batch_size=s.batch_size,
            shuffle=True,
            num_workers=s.workers,
            persistent_workers=s.workers > 0,
            pin_memory=s.device != "cpu",
            transform=recipe,
            dtype=s.dtype,
            channels_last=s.channels_last,
            device=s.device,
            decoder=decoder,
            cpu_share=cpu_share,
            drop_last=True,  # one batch shape for every pipeline (a new one re-tunes cuDNN)
            worker_nice=nice,
        )

    def epoch(self) -> Iterator:
        yield from self.dl

    def rest(self) -> None:
        """Between timed passes: drop the next epoch's batches made past the pass's end.
        Made while other pipelines run their passes, they would be a head start no one
        timed (and would take cores and GPU from those passes); within a pass, from one
        epoch to the next, that head start is timed, as it is in a training loop."""
        self.dl._session.end_read()  # an epoch read whole, not asked past, goes to the carry
        self.dl._session.drop_carry()

    def close(self) -> None:
        self.dl.close()
