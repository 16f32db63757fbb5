"""The byte rows quantized backends put on the wire: ``[codes | zero pad to 4 bytes | fp32 scales]``, one row per
destination (qgZ's and ByteGrad's all-to-alls; ByteGrad's "scales" are a chunk's mins then maxs) or per rank (qwZ's
all-gather), so codes and scales travel in one collective."""
from __future__ import annotations

import torch


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def row_bytes(code_bytes: int, groups: int) -> int:
    """Bytes of one row holding ``code_bytes`` of codes and ``groups`` fp32 scales."""
    return round_up(code_bytes, 4) + 4 * groups


def empty_rows(rows: int, code_bytes: int, groups: int, codes_dtype: torch.dtype, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(buffer [rows, row] uint8, codes [rows, code_bytes], scales [rows, groups] fp32)``: rows to quantize into
    (the quantizing kernels' ``out=``, in place on CUDA), the last two views of the first. The padding between codes
    and scales is zeroed, so no uninitialised byte goes on the wire."""
    cb_pad = round_up(code_bytes, 4)
    buf = torch.empty(rows, cb_pad + 4 * groups, dtype=torch.uint8, device=device)
    if cb_pad > code_bytes:
        buf[:, code_bytes:cb_pad].zero_()
    codes, scales = unpack_rows(buf, rows, code_bytes, codes_dtype)
    return buf, codes, scales


def unpack_rows(buf: torch.Tensor, rows: int, code_bytes: int, codes_dtype: torch.dtype, groups: int = -1):
    """``(codes [rows, code_bytes], scales [rows, groups] fp32)``: views of a received ``[rows, row]`` buffer (no
    copy: the kernels read rows at any stride). A row is a multiple of 4 bytes, so the scales view is aligned.
    ``groups``: scales per row (default: the rest of the row)."""
    b = buf if buf.dim() == 2 and buf.shape[0] == rows else buf.view(rows, -1)   # (each view costs host time)
    cb_pad = round_up(code_bytes, 4)
    end = b.shape[1] if groups < 0 else cb_pad + 4 * groups
    codes = b[:, :code_bytes]
    return codes if codes.dtype == codes_dtype else codes.view(codes_dtype), b[:, cb_pad:end].view(torch.float32)
