"""grid_sample: values of a 2-d image at the positions a grid holds, as
torch.nn.functional.grid_sample computes them (bilinear or nearest sampling; zeros, border or
reflection padding; align_corners either way); affine_grid: the grid an affine transform makes.

A grid position in [-1, 1] maps to a pixel coordinate (-1 and 1 are the centres of the corner
pixels with align_corners, their outer edges without); border padding clamps the coordinate
into the image, reflection mirrors it at the edges and then clamps, and zeros padding reads
zero for every neighbour outside. Coordinates are computed in float32 (float64 for float64),
as PyTorch does.
"""
from kiln import dtypes
from kiln.graph import OperatorError, operator
from kiln.ir import abs_, cast, compute, eq, floor, fmod, maximum, minimum, round_even, select

from kiln_ops_builtin.common import check_dtype, in_bounds

MODES = ("bilinear", "nearest")
PADDINGS = ("zeros", "border", "reflection")


def _reflect(x, twice_low: int, twice_high: int):
    """x mirrored into [twice_low / 2, twice_high / 2] (PyTorch's reflect_coordinates)."""
    if twice_low == twice_high:
        return x * 0
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    x = abs_(x - low)
    extra, flips = fmod(x, span), floor(x / span)
    return select(eq(fmod(flips, 2), 0), extra + low, span - extra + low)


def _source(coord, size: int, padding: str, align_corners: bool):
    """The pixel coordinate a normalized grid coordinate points at, after padding rules."""
    x = (coord + 1) / 2 * (size - 1) if align_corners else ((coord + 1) * size - 1) / 2
    if padding == "reflection":
        x = _reflect(x, 0, 2 * (size - 1)) if align_corners else _reflect(x, -1, 2 * size - 1)
    if padding in ("border", "reflection"):
        x = minimum(maximum(x, 0), size - 1)
    return x


@operator("grid_sample")
def grid_sample(input, grid, mode="bilinear", padding_mode="zeros", align_corners=False):
    """torch.nn.functional.grid_sample for 4-d inputs (N, C, H, W) and grids (N, Ho, Wo, 2)
    holding (x, y) per output pixel; bicubic sampling and 5-d inputs are not supported."""
    op = "grid_sample"
    if mode not in MODES or padding_mode not in PADDINGS:
        raise OperatorError(f"{op}: mode {mode!r} / padding_mode {padding_mode!r} not supported; "
                            f"modes {MODES}, padding modes {PADDINGS}")
    check_dtype(op, input, dtypes.FLOATS)
    check_dtype(op, grid, dtypes.FLOATS)
    if input.ndim != 4 or grid.ndim != 4 or grid.shape[-1] != 2 or grid.shape[0] != input.shape[0]:
        raise OperatorError(f"{op}: expected input (N, C, H, W) and grid (N, Ho, Wo, 2) with one N, got "
                            f"{input.shape} and {grid.shape} (5-d volumes are not supported)")
    n, c, h, w = input.shape
    coord_type = dtypes.float64 if input.dtype == dtypes.float64 else dtypes.float32
    align = bool(align_corners)

    def element(b, ch, oy, ox):
        x = _source(cast(grid[b, oy, ox, 0], coord_type), w, padding_mode, align)
        y = _source(cast(grid[b, oy, ox, 1], coord_type), h, padding_mode, align)

        def pixel(iy, ix):
            iy, ix = cast(iy, dtypes.int64), cast(ix, dtypes.int64)
            inside = in_bounds([iy, ix], (h, w))
            value = input[b, ch, minimum(maximum(iy, 0), h - 1), minimum(maximum(ix, 0), w - 1)]
            return select(inside, cast(value, coord_type), 0)

        if mode == "nearest":
            return pixel(round_even(y), round_even(x))
        x0, y0 = floor(x), floor(y)
        fx, fy = x - x0, y - y0
        return ((pixel(y0, x0) * (1 - fx) + pixel(y0, x0 + 1) * fx) * (1 - fy)
                + (pixel(y0 + 1, x0) * (1 - fx) + pixel(y0 + 1, x0 + 1) * fx) * fy)

    return compute((n, c) + tuple(grid.shape[1:3]), element, dtype=input.dtype)


def _base(i, steps: int, align_corners: bool, dtype):
    """The normalized coordinate of pixel `i` of `steps` (torch's linspace from -1 to 1, shrunk
    to the pixel centres without align_corners; 0 for a single pixel)."""
    if steps <= 1:
        return cast(0, dtype)
    x = cast(i, dtype) * (2 / (steps - 1)) - 1
    return x if align_corners else x * ((steps - 1) / steps)


@operator("affine_grid")
def affine_grid(theta, size, align_corners=False):
    """torch.nn.functional.affine_grid for 2-d images: theta (N, 2, 3), size (N, C, H, W), the
    grid (N, H, W, 2) of theta applied to each output pixel's (x, y, 1); 3-d volumes (5-d size)
    are not supported."""
    op = "affine_grid"
    check_dtype(op, theta, dtypes.FLOATS)
    size = [int(s) for s in size]
    if len(size) != 4 or theta.shape != (size[0], 2, 3):
        raise OperatorError(f"{op}: expected theta (N, 2, 3) and size (N, C, H, W), got {theta.shape} and "
                            f"{tuple(size)} (5-d sizes, 3-d volumes, are not supported)")
    n, _, h, w = size
    align = bool(align_corners)

    def element(b, y, x, c):
        return (_base(x, w, align, theta.dtype) * theta[b, c, 0] + _base(y, h, align, theta.dtype) * theta[b, c, 1]
                + theta[b, c, 2])

    return compute((n, h, w, 2), element, dtype=theta.dtype)
