"""--decode gpu's geometry as batched device work: each decoded image's crop box resized to size x
size (bilinear, antialiased: torchvision's RandomResizedCrop on tensors) and flipped, for the whole
batch in a fixed number of torch operations, whatever the batch size: no Python loop per image
launches work, and nothing is read back from the device.

The images have different sizes and crops, and torch has no resize over ragged inputs. The resize is
separable, a matrix on each side of the image: out_i = Wy_i @ X_i @ Wx_i^T, where Wx_i maps the
crop's columns to `size` outputs (the flip reverses its output order) and Wy_i its rows. Their
entries are torch's own antialiased bilinear weights (aten's _upsample_bilinear2d_aa: a triangle
filter widened by the scale when shrinking, normalised), computed for the whole batch at once on the
device from the boxes (small: taps x outputs). Then two passes:

- columns: one batched matrix product over the images as a nested tensor (planar (3H_i, W_i) @ (W_i,
  size)), whose output rows all have `size` values: they stack into one (sum of 3H_i, size) matrix.
  torch runs it as one grouped GEMM on sm80 (A100) and, on other GPUs (sm90: H100, H200), as one
  cuBLAS GEMM per image launched from C++ (aten's bmm_nested_cuda): there a launch per image
  remains, made by C++ instead of Python (not measured yet: BENCHMARKS.md); the TF32 setting
  applies (--tf32: within one level still);
- rows: one sparse (CSR) matrix product, each output row a fixed number of taps (zero-weighted where
  the filter is shorter) into that stacked matrix: (N x 3 x size) rows -> the batch in NCHW.

The arithmetic is float32, so the result is torch's float path's (interpolate on the float crop,
rounded): within one level of it, and within one level of --decode fast's uint8 kernel (which rounds
between its two passes; torch's two kernels differ by one level in ~16 % of pixels of a noise
image)."""
import math
import warnings

import torch

from dlojzlib import compat

# torch says, once per process, that nested tensors are a prototype and sparse CSR tensors in beta:
# both are what this module is built on, on purpose (checked at the floor and the newest torch)
warnings.filterwarnings('ignore', message='.*nested tensors is in prototype', category=UserWarning)
warnings.filterwarnings('ignore', message='.*Sparse CSR tensor support is in beta',
                        category=UserWarning)


def on_device(rows, device):
    """Host integers -> one int64 tensor on `device`: on a GPU through pinned memory and an
    asynchronous copy on the current stream. torch.tensor(list, device='cuda') copies from pageable
    memory and waits for the stream (cudaStreamSynchronize), which here is the geometry stream,
    itself waiting for the decode: one host wait per call, per batch."""
    table = torch.tensor(rows, dtype=torch.int64)
    if device.type == 'cuda':
        return table.pin_memory().to(device, non_blocking=True)
    return table.to(device)


def taps(starts, lengths, longest, size):
    """torch's antialiased bilinear resize (align_corners=False) of the window [start, start +
    length) of each line to `size` outputs, as taps: -> (first tap (N, size) int64, weights (N,
    size, K) float32), where output o of line n reads pixels first[n, o] + k with weight w[n, o, k].
    starts and lengths are (N,) int64 on the device; K covers the longest filter of the batch
    (`longest`, the host's: nothing is read back from the device); the taps past a shorter filter
    weigh 0."""
    n, device = len(lengths), lengths.device
    support_max = max(longest / size, 1.0)  # the filter's half-width, in input pixels
    k = int(math.floor(2 * support_max)) + 2
    f64 = dict(dtype=torch.float64, device=device)
    length = lengths.to(torch.float64).view(n, 1)
    scale = length / size
    support = scale.clamp(min=1.0)
    center = scale * (torch.arange(size, **f64).view(1, size) + 0.5)
    first = (center - support + 0.5).floor().clamp(min=0)               # aten: max(int(...), 0)
    end = torch.minimum((center + support + 0.5).floor(), length)      # aten: min(int(...), length)
    r = first.unsqueeze(-1) + torch.arange(k, **f64)                     # (n, size, k)
    w = (1 - ((r - center.unsqueeze(-1) + 0.5) / support.unsqueeze(-1)).abs()).clamp(min=0)
    w = torch.where(r < end.unsqueeze(-1), w, torch.zeros_like(w))
    w = w / w.sum(-1, keepdim=True)
    return first.to(torch.int64) + starts.view(n, 1), w.to(torch.float32)


def column_matrices(left, width, flip, widths, image_width, size, first, w):
    """The nested (W_i, size) matrices Wx_i^T of the batch, from the columns' taps: column c of the
    image feeds output x with the filter's weight; a flipped image's outputs in reverse order.
    left, width (the boxes'), flip and image_width are (N,) on the device; widths the images', on
    the host."""
    n, k, device = len(widths), w.shape[-1], w.device
    last = (left + width - 1).view(n, 1, 1)
    # taps past the filter weigh 0: any column inside the box takes them (added, they change
    # nothing)
    column = torch.minimum(first.unsqueeze(-1) + torch.arange(k, device=device), last)
    out = torch.arange(size, device=device).view(1, size, 1)
    out = torch.where(flip.view(n, 1, 1) > 0, size - 1 - out, out)
    offsets = (torch.cumsum(image_width, 0) - image_width) * size
    index = offsets.view(n, 1, 1) + column * size + out  # row c, column x of matrix n
    flat = torch.zeros(sum(widths) * size, dtype=torch.float32, device=device)
    flat.scatter_add_(0, index.reshape(-1), w.reshape(-1))
    return compat.nested_view(flat, [(wd, size) for wd in widths])


def row_operator(heights, height, size, first, w):
    """The CSR matrix (N x 3 x size rows, sum of 3H_i + K columns) that resizes the stacked rows of
    the column pass, from the rows' taps: row (n, c, y) holds K taps into image n's channel c, at K
    distinct, increasing columns (a window of K rows that holds the filter's, the others weighing
    0), so that the sparse product adds nothing twice and needs no count read back from the device.
    heights: the images', on the host; height: the same, (N,) on the device."""
    n, k, device = len(heights), w.shape[-1], w.device
    height = height.view(n, 1)
    window = torch.minimum(first, height - k).clamp(min=0)              # (n, size)
    weight = torch.zeros(n, size, k, dtype=torch.float32, device=device)
    # the filter's taps within the window: tap j of the filter is window column first - window + j
    shift = (first - window).unsqueeze(-1) + torch.arange(k, device=device)
    weight.scatter_add_(2, shift.clamp(max=k - 1), torch.where(shift < k, w, torch.zeros_like(w)))
    base = (torch.cumsum(height.view(n), 0) - height.view(n)) * 3
    channel = torch.arange(3, device=device).view(1, 3, 1, 1) * height.view(n, 1, 1, 1)
    columns = (base.view(n, 1, 1, 1) + channel + window.view(n, 1, size, 1)
               + torch.arange(k, device=device)).reshape(-1)           # (n, 3, size, k)
    values = weight.unsqueeze(1).expand(n, 3, size, k).reshape(-1)
    rows = n * 3 * size
    crow = torch.arange(rows + 1, dtype=torch.int64, device=device) * k
    return torch.sparse_csr_tensor(crow, columns, values, size=(rows, 3 * sum(heights) + k),
                                   check_invariants=False)


def resized_crops(images, boxes, size):
    """uint8 (3, H_i, W_i) images on one device and their boxes (top, left, height, width, flip) ->
    uint8 (N, 3, size, size): each box resized (antialiased bilinear) and flipped where asked. The
    batch's numbers reach the device in one asynchronous copy; nothing is read back."""
    device = images[0].device
    heights, widths = [x.shape[1] for x in images], [x.shape[2] for x in images]
    flat = torch.cat([x.reshape(-1) for x in images]).to(torch.float32)
    n = len(images)
    top, left, h, w, flip, height, width = on_device(
        [[b[0] for b in boxes], [b[1] for b in boxes], [b[2] for b in boxes], [b[3] for b in boxes],
         [int(bool(b[4])) for b in boxes], heights, widths], device)
    # the rows' and the columns' filters in one computation: its launches do not grow with n
    longest = max(max(b[2] for b in boxes), max(b[3] for b in boxes))
    first, weights = taps(torch.cat([top, left]), torch.cat([h, w]), longest, size)
    planes = compat.nested_view(flat, [(3 * hi, wi) for hi, wi in zip(heights, widths)])
    matrices = column_matrices(left, w, flip, widths, width, size, first[n:], weights[n:])
    columns = torch.bmm(planes, matrices)
    stacked = columns.values().view(-1, size)                           # (sum 3H_i, size)
    rows = row_operator(heights, height, size, first[:n], weights[:n])
    stacked = torch.cat([stacked, stacked.new_zeros(rows.shape[1] - stacked.shape[0], size)])
    out = (rows @ stacked).view(n, 3, size, size)
    return out.round_().clamp_(0, 255).to(torch.uint8)
