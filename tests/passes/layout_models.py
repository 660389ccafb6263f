"""Small convolutional models of the layout tests, each built around a case of
`kiln.passes.layout` (torchvision is not a test dependency)."""
import torch
import torch.nn.functional as F
from torch import nn


def randomized(model: nn.Module) -> nn.Module:
    """`model` in eval mode with batch norms whose statistics and affine parameters are random."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return model.eval()


def conv_bn(cin, cout, kernel=3, stride=1, groups=1):
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1, self.conv2 = conv_bn(cin, cout, stride=stride), conv_bn(cout, cout)
        self.downsample = None if stride == 1 and cin == cout else conv_bn(cin, cout, 1, stride)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(self.conv2(F.relu(self.conv1(x))) + identity)


class Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        self.body = nn.Sequential(conv_bn(cin, width, 1), nn.ReLU(), conv_bn(width, width, 3, stride),
                                  nn.ReLU(), conv_bn(width, width * 4, 1))
        self.downsample = conv_bn(cin, width * 4, 1, stride)

    def forward(self, x):
        return F.relu(self.body(x) + self.downsample(x))


class Stem(nn.Module):
    """A first layer on 3 channels, then max pooling and a basic block."""

    def __init__(self):
        super().__init__()
        self.conv = conv_bn(3, 8, 7, 2)
        self.block = BasicBlock(8, 8)

    def forward(self, x):
        return self.block(F.max_pool2d(F.relu(self.conv(x)), 3, 2, 1))


class DenseAndInception(nn.Module):
    """A DenseNet layer (batch norm, ReLU and a convolution, whose features are concatenated
    to its input) and an Inception module (branches of 1x1, 3x3 and pooled 1x1 convolutions
    concatenated)."""

    def __init__(self, c=8):
        super().__init__()
        self.stem = conv_bn(c, c)
        self.dense = nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, 4, 3, padding=1))
        self.branch1, self.branch3 = conv_bn(c + 4, 4, 1), conv_bn(c + 4, 6, 3)
        self.pooled = conv_bn(c + 4, 2, 1)
        self.out = conv_bn(12, 8, 1)

    def forward(self, x):
        h = F.relu(self.stem(x))
        h = torch.cat([h, self.dense(h)], 1)
        branches = [self.branch1(h), self.branch3(h), self.pooled(F.avg_pool2d(h, 3, 1, 1))]
        return F.relu(self.out(torch.cat([F.relu(b) for b in branches], dim=-3)))


class SplitsAndSoftmax(nn.Module):
    """A channel split and shuffle (ShuffleNet), a slice of rows, a softmax over the channels
    (a segmentation head)."""

    def __init__(self, c=8):
        super().__init__()
        self.conv, self.branch = conv_bn(c, c), conv_bn(c // 2, c // 2)
        self.head = nn.Conv2d(c, 5, 1)

    def forward(self, x):
        a, b = F.relu(self.conv(x)).chunk(2, dim=1)
        h = torch.cat([b, F.relu(self.branch(a))], 1)[:, :, 1:]
        parts = torch.split(h, [3, 5], dim=1)
        return F.softmax(self.head(torch.cat([parts[1], parts[0]], 1)), dim=1)


class WithIntermediate(nn.Module):
    """Returns a tensor from inside the region next to the block's output."""

    def __init__(self):
        super().__init__()
        self.conv = conv_bn(8, 8)
        self.block = BasicBlock(8, 8)

    def forward(self, x):
        h = F.relu(self.conv(x))
        return self.block(h), h


class Classifier(nn.Module):
    """Convolutions, then adaptive average pooling, flatten and a linear head."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(conv_bn(8, 16, 3, 2), nn.ReLU(), BasicBlock(16, 16))
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.body(x), 1), 1))


class TinyResNet(nn.Module):
    """ResNet-18's structure at toy width (torchvision is not a test dependency)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, 8, 3), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        self.layers = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8), BasicBlock(8, 16, 2),
                                    BasicBlock(16, 16), BasicBlock(16, 24, 2))
        self.fc = nn.Linear(24, 10)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), (1, 1)), 1))


class Pools(nn.Module):
    """Pooling variants between convolutions, and an adaptive max pooling head."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = conv_bn(8, 8), conv_bn(8, 8)
        self.fc = nn.Linear(8 * 2 * 3, 4)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.conv1(x)), 3, 2, 1, dilation=1, ceil_mode=True)
        h = F.avg_pool2d(h, 2, 1, 1, ceil_mode=False, count_include_pad=False)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2, dilation=2)
        return self.fc(torch.flatten(F.adaptive_max_pool2d(h, (2, 3)), 1))


class Broadcasts(nn.Module):
    """Bias-like operands of shapes (1, C, 1, 1) and (C, 1, 1), activations, a gate, padding."""

    def __init__(self, c=8):
        super().__init__()
        self.conv1, self.conv2 = conv_bn(c, c), conv_bn(c, c)
        self.scale = nn.Parameter(torch.rand(1, c, 1, 1) + 0.5)
        self.shift = nn.Parameter(torch.randn(c, 1, 1))

    def forward(self, x):
        h = F.hardswish(self.conv1(x) * self.scale + self.shift)
        h = h * torch.sigmoid(self.conv2(h)) - 0.25
        h = F.pad(F.pad(h, (1, 2, 0, 1)), (1, 1, 2, 0), mode="reflect")
        return F.silu(h)


class SqueezeExcite(nn.Module):
    """A squeeze-and-excitation gate (mean over H and W kept as (N, C, 1, 1), 1x1 convolutions,
    sigmoid) and a head that means over H and W without keepdim (timm's)."""

    def __init__(self, c=8):
        super().__init__()
        self.conv = conv_bn(c, c)
        self.squeeze, self.excite = nn.Conv2d(c, 4, 1), nn.Conv2d(4, c, 1)
        self.fc = nn.Linear(c, 3)

    def forward(self, x):
        h = F.relu(self.conv(x))
        h = h * torch.sigmoid(self.excite(F.relu(self.squeeze(h.mean((2, 3), keepdim=True)))))
        return self.fc(h.mean((-1, -2))), h.amax(1, keepdim=True), h.sum(2)


class ConvNeXtStage(nn.Module):
    """A patchifying convolution, then a ConvNeXt block: a depthwise 7x7 convolution, the
    model's own permute to NHWC, layer norm and an MLP over the channels, the permute back, a
    residual add."""

    def __init__(self, c=8):
        super().__init__()
        self.patchify = nn.Conv2d(4, c, 2, 2)
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm, self.up, self.down = nn.LayerNorm(c), nn.Linear(c, 2 * c), nn.Linear(2 * c, c)

    def forward(self, x):
        x = self.patchify(x)
        h = self.dw(x).permute(0, 2, 3, 1)
        h = self.down(F.gelu(self.up(self.norm(h)))).permute(0, 3, 1, 2)
        return x + h


def layer_norm_2d(x, norm: nn.LayerNorm):
    """torchvision's LayerNorm2d: a layer norm over the channels of NCHW data, by permutes."""
    return norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class SqueezeExcitation(nn.Module):
    """torchvision's: average pool to (N, C, 1, 1), two 1x1 convolutions, a gate, a product."""

    def __init__(self, c, squeezed, activation=nn.ReLU, gate=nn.Hardsigmoid):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, squeezed, 1), nn.Conv2d(squeezed, c, 1)
        self.activation, self.gate = activation(), gate()

    def forward(self, x):
        return x * self.gate(self.fc2(self.activation(self.fc1(F.adaptive_avg_pool2d(x, 1)))))


class InvertedResidual(nn.Module):
    """MobileNetV3's and EfficientNet's block: a 1x1 expansion, a depthwise convolution, an
    optional squeeze-excitation, a 1x1 projection, a residual add where the shapes allow."""

    def __init__(self, cin, expanded, cout, kernel, stride, activation, se=None):
        super().__init__()
        layers = [] if expanded == cin else [conv_bn(cin, expanded, 1), activation()]
        layers += [conv_bn(expanded, expanded, kernel, stride, groups=expanded), activation()]
        layers += [] if se is None else [se(expanded)]
        self.body = nn.Sequential(*layers, conv_bn(expanded, cout, 1))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


class TinyMobileNet(nn.Module):
    """MobileNetV3-large's and EfficientNet-B0's blocks at toy width: a hardswish stem; an
    inverted residual with hardswish, a 5x5 stride-2 depthwise convolution and a
    squeeze-excitation gated by hardsigmoid (MobileNetV3's); one with SiLU, a 3x3 depthwise
    convolution, a squeeze-excitation gated by a sigmoid with 6 squeezed channels (no multiple
    of 8) and a residual add (EfficientNet's); the pooled head (1x1 convolution, flatten,
    linear)."""

    def __init__(self):
        super().__init__()
        hard = lambda c: SqueezeExcitation(c, c // 4)
        efficient = lambda c: SqueezeExcitation(c, 6, nn.SiLU, nn.Sigmoid)
        self.stem = nn.Sequential(conv_bn(3, 16, 3, 2), nn.Hardswish())
        self.blocks = nn.Sequential(InvertedResidual(16, 48, 24, 5, 2, nn.Hardswish, hard),
                                    InvertedResidual(24, 72, 24, 3, 1, nn.SiLU, efficient))
        self.head = nn.Sequential(conv_bn(24, 96, 1), nn.Hardswish())
        self.fc = nn.Linear(96, 10)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.head(self.blocks(self.stem(x))), 1), 1))


class ConvNeXtBlock(nn.Module):
    """torchvision's CNBlock (`nhwc_scale` False: the layer scale, of shape (C, 1, 1), multiplies
    after the permute back) or timm's (True: of shape (C,), before it)."""

    def __init__(self, c, nhwc_scale=False):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm, self.up, self.down = nn.LayerNorm(c, eps=1e-6), nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.nhwc_scale = nhwc_scale
        self.scale = nn.Parameter(torch.rand(c) + 0.5 if nhwc_scale else torch.rand(c, 1, 1) + 0.5)

    def forward(self, x):
        h = self.down(F.gelu(self.up(self.norm(torch.permute(self.dw(x), [0, 2, 3, 1])))))
        h = torch.permute(h * self.scale, [0, 3, 1, 2]) if self.nhwc_scale else self.scale * h.permute(0, 3, 1, 2)
        return h + x


class TinyConvNeXt(nn.Module):
    """ConvNeXt-tiny's structure at toy width: a 4x4 stride-4 patchifying stem and LayerNorm2d,
    a block of each kind, a downsampling LayerNorm2d and 2x2 stride-2 convolution, the pooled
    head (LayerNorm2d, flatten)."""

    def __init__(self):
        super().__init__()
        self.stem, self.stem_norm = nn.Conv2d(3, 16, 4, 4), nn.LayerNorm(16, eps=1e-6)
        self.blocks = nn.Sequential(ConvNeXtBlock(16), ConvNeXtBlock(16, nhwc_scale=True))
        self.down_norm, self.down = nn.LayerNorm(16, eps=1e-6), nn.Conv2d(16, 24, 2, 2)
        self.head_norm = nn.LayerNorm(24, eps=1e-6)

    def forward(self, x):
        h = self.down(layer_norm_2d(self.blocks(layer_norm_2d(self.stem(x), self.stem_norm)), self.down_norm))
        return torch.flatten(layer_norm_2d(F.adaptive_avg_pool2d(h, 1), self.head_norm), 1)
