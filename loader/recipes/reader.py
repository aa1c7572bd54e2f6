"""The recipe reader: a torchvision recipe, step by step, into a ``Transform``'s arguments."""

from __future__ import annotations

from loader.augment import Transform
from loader.ops.autoaugment import AutoAugment, RandAugment, TrivialAugmentWide
from loader.ops.color import ColorJitter, RandomGrayscale
from loader.ops.erasing import RandomErasing
from loader.recipes.names import NotARecipe, interpolation
from loader.recipes.names import name as _name
from loader.recipes.timm import TimmSteps


class Reader(TimmSteps):
    """Reads a recipe step by step into the arguments of a ``Transform``."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.args: dict = {}
        self.resize: int | None = None  # eval: Resize seen, CenterCrop expected
        self.flip: float | None = None
        self.tensor: str | None = None  # None (PIL), "uint8" or "float"
        self.normalized = False
        self.steps: list = []  # the pixel steps after the crop
        self.erasing: RandomErasing | None = None

    def read(self, step) -> None:
        name = _name(step)
        handler = getattr(self, f"_{name.replace('.', '_')}", None) if name else None
        if handler is None:
            what = name or type(step).__name__
            raise NotARecipe(f"{what} is not a step the loader runs itself")
        if self.erasing is not None:
            raise NotARecipe(f"{name} comes after RandomErasing")
        if self.normalized and not name.endswith("RandomErasing"):
            raise NotARecipe(f"{name} comes after Normalize")
        handler(step)

    def _pixels(self, step) -> None:
        """Where a pixel step may come: after the crop, on uint8 pixels."""
        if self.kind is None or "size" not in self.args:
            raise NotARecipe(f"{_name(step)} comes before the crop (the loader runs it after)")
        if self.tensor == "float":
            raise NotARecipe(f"{_name(step)} comes after the conversion to float")

    def _ColorJitter(self, step) -> None:
        self._pixels(step)
        ranges = {}
        for name in ("brightness", "contrast", "saturation", "hue"):
            value = getattr(step, name)
            ranges[name] = None if value is None else (float(value[0]), float(value[1]))
        self.steps.append(ColorJitter(**ranges))

    def _RandomGrayscale(self, step) -> None:
        self._pixels(step)
        self.steps.append(RandomGrayscale(float(step.p)))

    def _auto_augment(self, step, kind: type, **args) -> None:
        """torchvision's RandAugment, TrivialAugmentWide or AutoAugment as ours, ``kind``."""
        self._pixels(step)
        fill = step.fill
        try:
            mode = getattr(step.interpolation, "value", step.interpolation)
            self.steps.append(kind(interpolation=mode, fill=fill, **args))
        except ValueError as e:
            raise NotARecipe(f"{_name(step)}: {e}") from None

    def _RandAugment(self, step) -> None:
        args = {k: getattr(step, k) for k in ("num_ops", "magnitude", "num_magnitude_bins")}
        self._auto_augment(step, RandAugment, **args)

    def _TrivialAugmentWide(self, step) -> None:
        self._auto_augment(step, TrivialAugmentWide, num_magnitude_bins=step.num_magnitude_bins)

    def _AutoAugment(self, step) -> None:
        self._auto_augment(step, AutoAugment, policy=getattr(step.policy, "value", step.policy))

    def _RandomErasing(self, step) -> None:
        if self.tensor != "float":
            raise NotARecipe("RandomErasing comes before the conversion to float")
        value = "random" if step.value is None else step.value  # (v2 keeps "random" so)
        if isinstance(value, str):
            if value != "random":
                raise NotARecipe(f"RandomErasing(value={value!r}) is not a fill it knows")
            fill, value = "pixel", (0.0, 0.0, 0.0)
        else:
            values = [float(value)] if isinstance(value, (int, float)) else list(map(float, value))
            if len(values) not in (1, 3):
                raise NotARecipe(f"RandomErasing(value={step.value!r}) is not 1 or 3 values")
            fill, value = "const", tuple(values * 3 if len(values) == 1 else values)
        self.erasing = RandomErasing(
            float(step.p), tuple(step.scale), tuple(step.ratio), fill, value
        )

    def _geometry(self, step, kind: str) -> None:
        if self.kind is not None:
            raise NotARecipe(f"{_name(step)} follows another resizing step")
        mode = interpolation(step)
        if mode != "bilinear":
            self.args["interpolation"] = mode
        self.kind = kind
        # On PIL images torchvision always antialiases; on tensors only if asked.
        # (timm's crop has no such attribute: on tensors it antialiases, torch's default)
        antialias = getattr(step, "antialias", True)
        self.args["antialias"] = True if self.tensor is None else bool(antialias)

    def _RandomResizedCrop(self, step) -> None:
        self._geometry(step, "train")
        self.args |= {"size": tuple(step.size), "scale": step.scale, "ratio": step.ratio}

    def _RandomHorizontalFlip(self, step) -> None:
        if self.flip is not None:
            raise NotARecipe("RandomHorizontalFlip appears twice")
        self.flip = float(step.p)

    def _Resize(self, step) -> None:
        size = step.size if isinstance(step.size, int) else list(step.size)
        if not isinstance(size, int) and len(size) == 1:
            size = size[0]
        if not isinstance(size, int) or step.max_size is not None:
            raise NotARecipe(f"Resize(size={step.size!r}) is not a resize of the short side")
        self._geometry(step, "eval")
        self.resize = size

    def _CenterCrop(self, step) -> None:
        if self.kind != "eval" or "size" in self.args:
            raise NotARecipe("CenterCrop does not directly follow Resize")
        size = tuple(step.size)
        if max(size) > self.resize:
            raise NotARecipe(f"CenterCrop{size} is larger than Resize({self.resize}): it pads")
        self.args |= {"size": size, "crop_pct": _crop_pct(max(size), self.resize)}

    def _to_float(self, step, frm: str | None) -> None:
        if self.tensor != frm:
            raise NotARecipe(f"{_name(step)} does not convert {frm or 'a PIL image'}")
        self.tensor = "float"

    def _ToTensor(self, step) -> None:
        self._to_float(step, None)

    def _PILToTensor(self, step) -> None:
        self._to_float(step, None)
        self.tensor = "uint8"

    _ToImage = _PILToTensor

    def _ConvertImageDtype(self, step) -> None:
        import torch  # lazy, as every import of this module's callers

        if step.dtype is not torch.float32:
            raise NotARecipe(f"ConvertImageDtype({step.dtype}) does not make float32")
        self._to_float(step, "uint8")

    def _ToDtype(self, step) -> None:
        import torch

        if step.dtype is not torch.float32 or not step.scale:
            raise NotARecipe("ToDtype is not ToDtype(torch.float32, scale=True)")
        self._to_float(step, "uint8")

    def _Normalize(self, step) -> None:
        if self.tensor != "float":
            raise NotARecipe("Normalize comes before the conversion to float")
        mean, std = tuple(map(float, step.mean)), tuple(map(float, step.std))
        if len(mean) != 3 or len(std) != 3:
            raise NotARecipe(f"Normalize has {len(mean)} channel(s), not 3")
        self.args |= {"mean": mean, "std": std}
        self.normalized = True

    def transform(self) -> Transform:
        if self.kind is None or "size" not in self.args:
            raise NotARecipe("it has no RandomResizedCrop, nor Resize followed by CenterCrop")
        if self.tensor != "float":
            raise NotARecipe("it does not end with a float tensor (ToTensor or ToDtype)")
        if self.kind == "eval" and self.flip is not None:
            raise NotARecipe("RandomHorizontalFlip with Resize + CenterCrop")
        args = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)} | self.args
        args |= {"steps": tuple(self.steps), "erasing": self.erasing}
        if self.kind == "train":
            args["flip"] = self.flip or 0.0
        try:
            return Transform(self.kind, **args)
        except ValueError as e:  # what torchvision only warns of (a reversed range...)
            raise NotARecipe(f"its parameters are not the loader's: {e}") from None


def _crop_pct(crop: int, short: int) -> float:
    """A ``crop_pct`` with ``int(crop / crop_pct) == short``, as ``Transform`` computes it."""
    pct = crop / short
    return pct if int(crop / pct) == short else crop / (short + 0.5)
