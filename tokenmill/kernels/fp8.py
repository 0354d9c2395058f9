"""8-bit float weights (float8 e4m3, as FP8 checkpoints store them), kept in float8 with their scales.

Every FP8 scheme the engine reads is one layout here: each weight value is ``qweight * scale``, with
one float32 scale per output row and block of ``block`` input columns (``block`` None: one scale
per row). A checkpoint's per-tensor scale is repeated over its rows and a 128 x 128 block's over
its 128 rows, so a fused q|k|v or gate|up matrix keeps each part's own scales exactly, and a
tensor-parallel rank's rows carry theirs whatever the split. Activations are quantized the same
way: per token over ``block`` columns at run time, or by the checkpoint's static ``input_scale``.

``FP8Weight`` is what the projection ops take in place of a dense weight: the CPU and the GPU's
one-row and few-row kernels read it against rows as they are (``reference.fp8_weight_linear``),
the GPU's FP8 tensor cores against rows quantized as above (``reference.fp8_linear``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The only block shape accepted: the one DeepSeek-V3, Qwen3-FP8 and compressed-tensors' FP8_BLOCK
# write, and the one GPU block-scaled kernels are built for.
BLOCK_SHAPE = (128, 128)


@dataclass(frozen=True)
class FP8Scheme:
    """How a checkpoint scales its FP8 projections: ``weight`` ``tensor`` (one scale per tensor),
    ``channel`` (one per output row) or ``block`` (one per ``BLOCK_SHAPE`` tile); ``static_input``:
    activations scaled by the checkpoint's ``input_scale`` (per tensor), else at run time per token
    (and per block of input columns with block weights). ``name`` says it in words, for errors and logs."""

    weight: str
    static_input: bool
    name: str

    def __post_init__(self) -> None:
        if self.weight not in ("tensor", "channel", "block"):
            raise ValueError(f"an FP8 weight strategy is tensor, channel or block, got {self.weight!r}")
        if self.static_input and self.weight == "block":
            raise ValueError("block-wise FP8 weights take dynamic activations only")

    @property
    def block(self) -> tuple[int, int] | None:
        return BLOCK_SHAPE if self.weight == "block" else None


@dataclass(frozen=True)
class FP8Weight:
    """A ``[N, K]`` matrix as ``qweight`` float8 e4m3 ``[N, K]`` and ``scales`` float32
    ``[N, ceil(K / block)]`` (``[N, 1]`` when ``block`` is None); ``input_scale``: the static
    activation scales of the fused parts (float32 ``[parts]``, the largest used: it clips nothing the
    others keep), None for dynamic ones."""

    qweight: torch.Tensor
    scales: torch.Tensor
    block: int | None = None
    input_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.qweight.dtype != FP8_DTYPE or self.qweight.dim() != 2:
            raise ValueError(
                f"an FP8 matrix is 2-D float8_e4m3fn, got {self.qweight.dtype} {tuple(self.qweight.shape)}"
            )
        n, k = self.qweight.shape
        shape = (n, 1 if self.block is None else -(-k // self.block))
        if tuple(self.scales.shape) != shape or self.scales.dtype != torch.float32:
            raise ValueError(f"FP8 scales must be float32 {shape}, got {self.scales.dtype} {tuple(self.scales.shape)}")
        if self.input_scale is not None and self.block is not None:
            raise ValueError("block-wise FP8 weights take dynamic activations only")

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.qweight.float() * expand_scales(self.scales, self.block, self.qweight.shape[1])).to(dtype)


def expand_scales(scales: torch.Tensor, block: int | None, k: int) -> torch.Tensor:
    """Scales of blocks of ``block`` columns (``[rows, ceil(k / block)]``) repeated over their columns,
    ``[rows, k]``; one scale a row (``block`` None) stays ``[rows, 1]``, which broadcasts."""
    return scales if block is None else scales.repeat_interleave(block, dim=1)[:, :k]


def quantize_groups(x: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[R, K]`` as float8 e4m3 values and float32 scales ``[R, ceil(K / block)]`` (``[R, 1]`` when
    ``block`` is None): each row's (block's) largest magnitude over 448, 1 for one of zeros; each value
    divided by its scale, clamped to ±448 and rounded to nearest."""
    r, k = x.shape
    x = x.float()
    width = k if block is None else block
    groups = -(-k // width)
    padded = torch.nn.functional.pad(x, (0, groups * width - k)).view(r, groups, width)
    scales = padded.abs().amax(dim=-1) / FP8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return (x / expand_scales(scales, block, k)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def quantize_rows(weight: torch.Tensor) -> FP8Weight:
    """``weight`` ``[N, K]`` in FP8 with one scale per output row (its largest magnitude over 448): what
    ``quantization="fp8"`` keeps of a dense checkpoint, its activations then quantized per token."""
    return FP8Weight(*quantize_groups(weight, None))
