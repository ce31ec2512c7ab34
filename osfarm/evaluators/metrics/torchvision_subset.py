"""The two pieces of torchvision that easyocr uses, for the moment easyocr is imported.

easyocr imports torchvision for ``transforms.ToTensor`` (a PIL image to a float CHW tensor in
[0, 1]) and ``models.vgg16_bn(...).features`` (the VGG-16 layer stack of its CRAFT text detector,
whose weights then come from EasyOCR's own ``craft_mlt_25k.pth``). PyPI's torchvision is built
against PyPI's CUDA torch: on osfarm's CPU torch its compiled ops do not load, its import fails,
and merely having it installed breaks transformers' image processors. So osfarm installs easyocr
without torchvision and, while easyocr is imported and its reader built, puts these
re-implementations (same layer types, order and defaults, so the state dict loads key for key)
in ``sys.modules`` under torchvision's names; afterwards the previous entries are restored, so
nothing else in the process sees them.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import numpy as np

# torchvision's VGG "D" configuration: channels of each 3x3 conv, "M" a 2x2 max-pool
_VGG16: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
VERSION = "0.28.0"  # what easyocr's version check reads (>= 0.13: the weights= keyword)


def _vgg16_bn_features() -> Any:
    import torch.nn as nn

    layers: list[nn.Module] = []
    channels = 3
    for v in _VGG16:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers += [nn.Conv2d(channels, int(v), kernel_size=3, padding=1), nn.BatchNorm2d(int(v)),
                       nn.ReLU(inplace=True)]
            channels = int(v)
    return nn.Sequential(*layers)


class VGG16_BN_Weights:  # noqa: N801 - torchvision's name
    DEFAULT = "IMAGENET1K_V1"


def vgg16_bn(weights: Any = None, pretrained: bool = False, **_: Any) -> Any:
    """An object whose ``features`` is VGG-16-BN's layer stack; ImageNet weights are not offered
    (easyocr's CRAFT asks for none: its own weights replace them)."""
    if weights is not None or pretrained:
        raise RuntimeError("torchvision_subset: ImageNet VGG weights are not available; build without them")
    return types.SimpleNamespace(features=_vgg16_bn_features())


class ToTensor:
    """A PIL image (or HxW[xC] uint8 array) as a float tensor of shape CxHxW in [0, 1]."""

    def __call__(self, pic: Any) -> Any:
        import torch

        arr = np.array(pic, dtype=np.uint8, copy=True)
        if arr.ndim == 2:
            arr = arr[:, :, None]
        return torch.from_numpy(arr).permute(2, 0, 1).contiguous().float().div(255)


def _modules() -> dict[str, types.ModuleType]:
    root = types.ModuleType("torchvision", "osfarm's stand-in for the torchvision pieces easyocr imports")
    models = types.ModuleType("torchvision.models")
    transforms = types.ModuleType("torchvision.transforms")
    models.vgg16_bn = vgg16_bn  # type: ignore[attr-defined]
    models.VGG16_BN_Weights = VGG16_BN_Weights  # type: ignore[attr-defined]
    transforms.ToTensor = ToTensor  # type: ignore[attr-defined]
    root.__version__ = VERSION  # type: ignore[attr-defined]
    root.models, root.transforms = models, transforms  # type: ignore[attr-defined]
    return {"torchvision": root, "torchvision.models": models, "torchvision.transforms": transforms}


@contextlib.contextmanager
def standing_in() -> Iterator[None]:
    """Within: ``import torchvision`` (and its ``models``/``transforms``) gives this subset."""
    mods = _modules()
    saved = {name: sys.modules.get(name) for name in mods}
    sys.modules.update(mods)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


__all__ = ["ToTensor", "standing_in", "vgg16_bn"]
