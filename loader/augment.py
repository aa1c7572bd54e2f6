"""Built-in transforms: the spec users choose ("train", "eval", Transform) and its crop sampler.

Crop parameters are drawn on the CPU for a whole batch at once, from the image sizes in the
store's index, before any image is decoded: the decoder needs them to pick a DCT-domain
reduction, and a GPU decoder can take them as they are. Each sample gets one row of
``CROP_COLUMNS``: a source window, the size it is resized to, the offset of the output
inside that resized window, and a flip bit. "train" draws windows exactly as torchvision's
``RandomResizedCrop.get_params`` does; "eval" is ``Resize(int(size / crop_pct))`` followed by
``CenterCrop(size)``, with torchvision's rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
KINDS = ("train", "eval")
INTERPOLATIONS = ("bilinear", "bicubic", "random")  # random: either, per image (timm's)

# Columns of a crop-parameter row (int32): window Y, X, H, W in source pixels; resized size
# RH, RW; output offset OY, OX inside the resized window; FLIP (1 = mirror left-right);
# CUBIC (1 = the bicubic filter, 0 = bilinear).
CROP_COLUMNS = ("y", "x", "h", "w", "rh", "rw", "oy", "ox", "flip", "cubic")
_RRC_TRIES = 10  # attempts before the central-crop fallback, as in torchvision


def _pair(name: str, value, kind=float) -> tuple:
    try:
        a, b = (kind(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is invalid: pass two numbers (low, high)") from None
    return a, b


@dataclass(frozen=True)
class Transform:
    """What the built-in pipeline does to each image; ``transform=`` takes one of these.

    Args:
        kind: "train" (random resized crop + flip) or "eval" (resize + centre crop).
        size: output (height, width), or one int for a square.
        scale: train: range of the crop's area as a fraction of the image's area.
        ratio: train: range of the crop's aspect ratio (width / height), drawn log-uniformly.
        flip: train: probability of a horizontal flip (0 for none).
        crop_pct: eval: the short side is resized to ``int(max(size) / crop_pct)``.
        mean: per-channel mean (RGB, 0..1) subtracted from float outputs.
        std: per-channel standard deviation (RGB, 0..1) dividing float outputs.
        antialias: shrink with an area filter (as torchvision's antialiased resize does)
            rather than plain bilinear sampling, which is faster but aliases.
        interpolation: "bilinear" (PIL's triangle filter) or "bicubic" (PIL's cubic,
            a = -0.5), as torchvision's ``Resize(..., interpolation=, antialias=True)``
            resizes a PIL image; with ``antialias=False``, torch's plain bicubic (a = -0.75);
            or, for train, "random": either of them, drawn per image (timm's default).
        steps: batched steps on the cropped uint8 pixels, in order (``loader.ops.color``:
            ``ColorJitter``, ``RandomGrayscale``): batched on the GPU, per image in the workers.
        erasing: a ``loader.ops.erasing.RandomErasing`` of the normalised batch, or None.

    Example:
        ``Transform("train", 176, scale=(0.35, 1), flip=0.0)``
    """

    kind: str = "train"
    size: int | tuple[int, int] = 224
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5
    crop_pct: float = 0.875
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    antialias: bool = True
    interpolation: str = "bilinear"
    steps: tuple = ()
    erasing: object = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"transform={self.kind!r} is not a built-in transform; use one of "
                f"{', '.join(map(repr, KINDS))}, a loader.Transform, or wrap the store in "
                "loader.LMDBDataset(root, transform=<torchvision transform>)"
            )
        size = (self.size, self.size) if isinstance(self.size, int) else self.size
        size = _pair("image_size", size, int)
        if min(size) < 1:
            raise ValueError(f"image_size={self.size!r} is invalid: sizes must be >= 1 pixel")
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "steps", tuple(self.steps))
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(
                f"interpolation={self.interpolation!r} is invalid: pass 'bilinear', 'bicubic' "
                "or (train) 'random'"
            )
        if self.interpolation == "random" and self.kind != "train":
            raise ValueError(
                "interpolation='random' is for kind='train': an eval transform resizes every "
                "image alike; pass 'bilinear' or 'bicubic'"
            )
        self._check_ranges()
        for name in ("mean", "std"):
            value = tuple(float(v) for v in getattr(self, name))
            if len(value) != 3 or (name == "std" and min(value) <= 0):
                raise ValueError(
                    f"{name}={value!r} is invalid: pass 3 numbers (R, G, B)"
                    + ("; std must be > 0" if name == "std" else "")
                )
            object.__setattr__(self, name, value)

    def _check_ranges(self) -> None:
        scale, ratio = _pair("scale", self.scale), _pair("ratio", self.ratio)
        if not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"scale={self.scale!r} is invalid: need 0 < low <= high <= 1")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio={self.ratio!r} is invalid: need 0 < low <= high")
        if not 0 <= self.flip <= 1:
            raise ValueError(f"flip={self.flip!r} is invalid: it is a probability in [0, 1]")
        if not 0 < self.crop_pct <= 1:
            raise ValueError(f"crop_pct={self.crop_pct!r} is invalid: need 0 < crop_pct <= 1")
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "ratio", ratio)


def resolve_transform(
    transform: str | Transform | None,
    image_size: int | tuple[int, int] | None = None,
    mean: tuple[float, float, float] | None = None,
    std: tuple[float, float, float] | None = None,
) -> Transform:
    """The Transform that ``DataLoader(transform=, image_size=, mean=, std=)`` asks for.

    Raises:
        ValueError: no transform, an unknown name, or ``image_size``/``mean``/``std`` given
            together with a Transform object (set them on the object instead).
    """
    if transform is None:
        raise ValueError(
            "transform= is required when reading a store: pass transform='train' (random "
            "resized crop + flip) or 'eval' (resize + centre crop), or a loader.Transform"
        )
    extra = {k: v for k, v in (("size", image_size), ("mean", mean), ("std", std)) if v is not None}
    if isinstance(transform, Transform):
        if extra:
            names = ", ".join("image_size" if k == "size" else k for k in extra)
            raise ValueError(
                f"{names} cannot be combined with a Transform object; set them on "
                f"it: Transform({transform.kind!r}, size=..., mean=..., std=...)"
            )
        return transform
    if not isinstance(transform, str):
        raise ValueError(
            f"transform={transform!r} is not a built-in transform: pass 'train', 'eval' or a "
            "loader.Transform (a torchvision transform goes on loader.LMDBDataset instead)"
        )
    return replace(Transform(transform), **extra) if extra else Transform(transform)


def plan_crops(
    spec: Transform, heights: np.ndarray, widths: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Crop parameters (int32 rows of CROP_COLUMNS) for images of the given sizes."""
    h = np.asarray(heights, dtype=np.int64)
    w = np.asarray(widths, dtype=np.int64)
    out = np.zeros((len(h), len(CROP_COLUMNS)), dtype=np.int64)
    if spec.kind == "train":
        out[:, 0:4] = random_resized_windows(h, w, spec.scale, spec.ratio, rng)
        out[:, 4:6] = spec.size
        out[:, 8] = rng.random(len(h)) < spec.flip
    else:
        out[:, 2], out[:, 3] = h, w
        out[:, 4:8] = centre_crop_resize(h, w, spec.size, spec.crop_pct)
    if spec.interpolation == "random":  # drawn last: the other draws stay as they were
        out[:, 9] = rng.random(len(h)) < 0.5
    else:
        out[:, 9] = spec.interpolation == "bicubic"
    return out.astype(np.int32)


def random_resized_windows(
    h: np.ndarray, w: np.ndarray, scale: tuple, ratio: tuple, rng: np.random.Generator
) -> np.ndarray:
    """Windows (y, x, h, w) distributed as torchvision's ``RandomResizedCrop.get_params``."""
    n = len(h)
    area = (h * w).astype(np.float64)[:, None]
    target = area * rng.uniform(scale[0], scale[1], (n, _RRC_TRIES))
    log_ratio = np.log(np.asarray(ratio, dtype=np.float64))
    aspect = np.exp(rng.uniform(log_ratio[0], log_ratio[1], (n, _RRC_TRIES)))
    # np.round rounds half to even, as Python's round() in torchvision does.
    cw = np.round(np.sqrt(target * aspect)).astype(np.int64)
    ch = np.round(np.sqrt(target / aspect)).astype(np.int64)
    fits = (cw > 0) & (cw <= w[:, None]) & (ch > 0) & (ch <= h[:, None])
    first = fits.argmax(axis=1)  # the first attempt that fits, as the loop takes it
    rows = np.arange(n)
    ch, cw = ch[rows, first], cw[rows, first]
    missed = ~fits.any(axis=1)
    if missed.any():
        ch[missed], cw[missed] = _central_fallback(h[missed], w[missed], ratio)
    y = rng.integers(0, h - ch + 1)
    x = rng.integers(0, w - cw + 1)
    # The fallback is centred, not drawn.
    y[missed], x[missed] = (h[missed] - ch[missed]) // 2, (w[missed] - cw[missed]) // 2
    return np.stack([y, x, ch, cw], axis=1)


def _central_fallback(h: np.ndarray, w: np.ndarray, ratio: tuple) -> tuple:
    """torchvision's fallback after ten misses: (h, w) of the largest crop within ``ratio``."""
    in_ratio = w / h
    lo, hi = min(ratio), max(ratio)
    cw, ch = w.copy(), h.copy()
    narrow, wide = in_ratio < lo, in_ratio > hi
    ch[narrow] = np.round(w[narrow] / lo).astype(np.int64)
    cw[wide] = np.round(h[wide] * hi).astype(np.int64)
    return ch, cw


def centre_crop_resize(h: np.ndarray, w: np.ndarray, size: tuple[int, int], crop_pct: float):
    """(rh, rw, oy, ox) of torchvision's ``Resize(short) + CenterCrop(size)`` per image."""
    short = int(max(size) / crop_pct)
    portrait = w <= h
    # torchvision: the short side becomes `short`, the long one int(short * long / short_side).
    rh = np.where(portrait, (short * h / w).astype(np.int64), short)
    rw = np.where(portrait, short, (short * w / h).astype(np.int64))
    oy = np.round((rh - size[0]) / 2.0).astype(np.int64)
    ox = np.round((rw - size[1]) / 2.0).astype(np.int64)
    return np.stack([rh, rw, oy, ox], axis=1)
