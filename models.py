"""DeepLabV3 and DeepLabV3+ on torchvision backbones.

    from models import DeepLab, build_model
    model = DeepLab()                               # DeepLabV3+ ResNet-101, output stride 16, 19 classes
    model = build_model("deeplabv3_mobilenet_v3_large", num_classes=19)
    model = build_model("deeplabv3plus_mobilenet_tiny")  # every part of DeepLabV3+, narrow: for tests, smoke runs

The model returns logits at the input's resolution, shape (N, num_classes, H, W).

Pieces come from torchvision: the backbones (ResNet with dilation instead of stride, MobileNetV3 with
its dilated last stage), IntermediateLayerGetter to read features out of them, and the ASPP module.
What torchvision lacks is the V3+ decoder (Chen et al., 2018, section 3.1): it upsamples ASPP's output
to the size of the backbone's stride-4 features (by 4 at output stride 16, by 2 at 8), concatenates 48
channels projected from them, and refines with two 3x3 convolutions. That is the only new module here.
"""
import os

import torch
import torch.nn.functional as F
from torch import nn
from torchvision import models
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.models.segmentation.deeplabv3 import ASPP

MODEL_NAMES = (  # the first is main.py's default: the recipe's
    "deeplabv3plus_resnet101", "deeplabv3plus_resnet50", "deeplabv3_resnet101", "deeplabv3_resnet50",
    "deeplabv3_mobilenet_v3_large", "deeplabv3plus_mobilenet_v3_large",
    # Not for accuracy: MobileNetV3-Small at half width under a 32-channel head, 0.56 M parameters (the MobileNet
    # above has 11.7 M). It has every part the others have and trains a step about 5 times faster on a CPU, with
    # checkpoints of 4.5 MB instead of 92: the tests' model, and a smoke run's. No ImageNet weights exist for it.
    "deeplabv3plus_mobilenet_tiny",
)
BACKBONES = ("resnet50", "resnet101", "mobilenet_v3_large", "mobilenet_tiny")


class WeightsError(ValueError):
    """Backbone weights that cannot be used: not downloadable here, not found, unreadable, or another network's. Its
    message names the file and what to give instead (main.py's harness says it in one line)."""


def _conv_bn_relu(in_channels, out_channels, kernel_size):
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


def _load_backbone_weights(net, backbone, pretrained):
    """pretrained: None (random init), "imagenet" (torchvision's weights, downloaded once into the torch
    hub cache), or the path of a .pth state dict of the torchvision classification model."""
    if pretrained is None or pretrained in ("", "none"):
        return
    if pretrained == "imagenet" and backbone == "mobilenet_tiny":
        raise WeightsError("--pretrained-backbone imagenet: mobilenet_tiny (MobileNetV3-Small at half width) has no "
                           "ImageNet weights; train it from scratch with --pretrained-backbone none")
    if pretrained == "imagenet":
        weights = {"resnet50": models.ResNet50_Weights.IMAGENET1K_V1,
                   "resnet101": models.ResNet101_Weights.IMAGENET1K_V1,
                   "mobilenet_v3_large": models.MobileNet_V3_Large_Weights.IMAGENET1K_V1}[backbone]
        try:
            state = weights.get_state_dict(progress=False)
        except Exception as error:  # no network, proxy, ...
            raise WeightsError(
                f"could not download the ImageNet weights of {backbone} ({weights.url}): {error}. "
                f"Download that file elsewhere and pass its path to --pretrained-backbone, or train from scratch with "
                f"--pretrained-backbone none") from None
    else:
        if os.path.isdir(pretrained):
            raise WeightsError(f"--pretrained-backbone {pretrained} is a folder: give the weights file in it")
        if not os.path.isfile(pretrained):
            raise WeightsError(f"--pretrained-backbone {pretrained}: no such file")
        try:
            state = torch.load(pretrained, map_location="cpu", weights_only=True)
        except Exception as error:
            raise WeightsError(f"--pretrained-backbone {pretrained} cannot be read ({type(error).__name__}): "
                               "an empty, truncated or non-PyTorch file; download it again") from None
        if isinstance(state, dict) and "model" in state and "classes" in state:  # this program's checkpoint
            raise WeightsError(f"--pretrained-backbone {pretrained} holds a whole DeepLab model, not {backbone}'s "
                               f"classification weights: fine-tune from it with --weights {pretrained}")
        if isinstance(state, dict) and any(str(k).startswith(("backbone.", "module.backbone.")) for k in state):
            raise WeightsError(f"--pretrained-backbone {pretrained} holds a segmentation model's weights (backbone.* "
                               f"keys), not {backbone}'s classification weights: give those, or none; a DeepLab "
                               "of this program goes to --weights")
        state = state.get("state_dict", state) if isinstance(state, dict) else state
        if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise WeightsError(f"--pretrained-backbone {pretrained} holds no state dict of weights: give the "
                               f"torchvision {backbone} classification weights (.pth)")
    # The classifier of the ImageNet model (fc / classifier) has no place here; everything else must fit.
    state = {k: v for k, v in state.items() if not k.startswith(("fc.", "classifier."))}
    own = net.state_dict()
    other = [k for k, v in state.items() if k in own and hasattr(v, "shape") and v.shape != own[k].shape]
    if other:  # (load_state_dict would list every one, over many lines)
        raise WeightsError(f"--pretrained-backbone {pretrained} does not fit {backbone}: {len(other)} tensors of "
                           f"another shape (e.g. {other[0]} {tuple(state[other[0]].shape)} vs "
                           f"{tuple(own[other[0]].shape)}): the weights of another network; give {backbone}'s")
    missing, unexpected = net.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(("fc.", "classifier."))]
    if missing or unexpected:
        raise WeightsError(f"--pretrained-backbone {pretrained} does not fit {backbone}: "
                           f"{len(missing)} missing keys (e.g. {missing[:3]}), "
                           f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})")


def _backbone(name, output_stride, pretrained):
    """-> (feature extractor returning {"out": stride-16/8 features, "low": stride-4 features},
    channels of "out", channels of "low")."""
    if name in ("resnet50", "resnet101"):
        if output_stride not in (8, 16):
            raise ValueError(f"output stride {output_stride}: ResNet backbones support 8 or 16")
        # Dilate the last one (OS16) or two (OS8) stages instead of striding, as DeepLab does.
        dilate = [False, output_stride == 8, True]
        net = getattr(models, name)(weights=None, replace_stride_with_dilation=dilate)
        _load_backbone_weights(net, name, pretrained)
        return IntermediateLayerGetter(net, {"layer1": "low", "layer4": "out"}), 2048, 256
    if name in ("mobilenet_v3_large", "mobilenet_tiny"):
        if output_stride != 16:
            raise ValueError(f"output stride {output_stride}: {name} supports 16 only")
        if name == "mobilenet_v3_large":
            net = models.mobilenet_v3_large(weights=None, dilated=True)  # last stage dilated: stride 16
        else:
            net = models.mobilenet_v3_small(weights=None, dilated=True, width_mult=0.5)
        _load_backbone_weights(net, name, pretrained)
        # torchvision builds MobileNetV3's BatchNorm with momentum 0.01 (an average over ~100 steps, made
        # for long ImageNet runs). In a short run its running statistics trail the weights, and the CPU demo
        # evaluated far worse with them (BENCHMARKS.md's notes). PyTorch's default, 0.1, as the ResNets and
        # the DeepLab head use.
        for module in net.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.momentum = 0.1
        features = net.features
        # The blocks that reduce resolution carry _is_cn; the one before the second of them ends stride 4.
        strided = [i for i, block in enumerate(features) if getattr(block, "_is_cn", False)]
        low = strided[1] - 1
        return (IntermediateLayerGetter(features, {str(low): "low", str(len(features) - 1): "out"}),
                features[-1].out_channels, features[low].out_channels)
    raise ValueError(f"unknown backbone {name!r}; choose from {', '.join(BACKBONES)}")


class _PoolingBatchNorm(nn.BatchNorm2d):
    """BatchNorm that, given a single value per channel in training, normalises with its running
    statistics (as in evaluation) instead of failing. With two or more values it is plain BatchNorm.
    SyncBatchNorm.convert_sync_batchnorm replaces it, as any BatchNorm, with a plain SyncBatchNorm (this
    fallback gone): main.py converts only with two or more processes, where the statistics come from every
    GPU's images, so never from fewer than two values per channel."""

    def forward(self, x):
        if self.training and x.shape[0] * x.shape[2] * x.shape[3] == 1:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        return super().forward(x)


class DeepLab(nn.Module):
    """DeepLabV3 (plus=False) or DeepLabV3+ (plus=True) for semantic segmentation.

    The defaults are main.py's recipe's model: DeepLabV3+, ResNet-101, output stride 16.
    """

    def __init__(self, num_classes=19, backbone="resnet101", plus=True, output_stride=16,
                 pretrained_backbone=None):
        super().__init__()
        self.backbone, channels, low_channels = _backbone(backbone, output_stride, pretrained_backbone)
        # Atrous rates scale with the output stride: (6, 12, 18) at 16, doubled at 8 (DeepLabV3 paper).
        rates = (6, 12, 18) if output_stride == 16 else (12, 24, 36)
        width = 32 if backbone == "mobilenet_tiny" else 256  # the tiny model: ASPP and decoder at 32 channels
        self.aspp = ASPP(channels, rates, out_channels=width)
        # ASPP's image-pooling branch normalises a 1x1 map: with one image in the batch, training-mode
        # BatchNorm has one value per channel and raises. That BatchNorm uses its running statistics then.
        pooling = self.aspp.convs[-1]
        pooling[2] = _PoolingBatchNorm(pooling[2].num_features)
        if plus:
            self.low_level = _conv_bn_relu(low_channels, 48, 1)
            self.decoder = nn.Sequential(_conv_bn_relu(width + 48, width, 3), _conv_bn_relu(width, width, 3))
        else:
            self.low_level = None
            self.decoder = _conv_bn_relu(width, width, 3)
        self.classifier = nn.Conv2d(width, num_classes, 1)

    def forward(self, images):
        features = self.backbone(images)
        x = self.aspp(features["out"])
        if self.low_level is not None:
            low = self.low_level(features["low"])
            x = F.interpolate(x, size=low.shape[-2:], mode="bilinear", align_corners=False)
            x = torch.cat([x, low], dim=1)
        x = self.classifier(self.decoder(x))
        return F.interpolate(x, size=images.shape[-2:], mode="bilinear", align_corners=False)


def build_model(name, num_classes=19, output_stride=16, pretrained_backbone=None):
    """A model by its --model name, e.g. "deeplabv3plus_resnet101"."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODEL_NAMES)}")
    head, backbone = name.split("_", 1)
    return DeepLab(num_classes, backbone, plus=head == "deeplabv3plus", output_stride=output_stride,
                   pretrained_backbone=pretrained_backbone)
