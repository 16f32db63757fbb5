"""The byte rows quantized backends put on the wire: ``[codes | zero pad to 4 bytes | fp32 scales]``, one row per
destination (qgZ's all-to-alls) or per rank (qwZ's all-gather), so codes and scales travel in one collective."""
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


def pack_rows(codes: torch.Tensor, scales: torch.Tensor, rows: int) -> torch.Tensor:
    """``[rows, row]`` uint8: row ``i`` holds the ``i``-th equal part of ``codes`` and of ``scales`` (a copy; for
    codes still to be computed, :func:`empty_rows` and the kernels' ``out=`` write the rows directly)."""
    c = codes.reshape(rows, -1).view(torch.uint8)
    s = scales.reshape(rows, -1).to(torch.float32).view(torch.uint8)
    cb = c.shape[1]
    cb_pad = round_up(cb, 4)
    out = torch.empty(rows, cb_pad + s.shape[1], dtype=torch.uint8, device=codes.device)
    out[:, :cb].copy_(c)
    if cb_pad > cb:
        out[:, cb:cb_pad].zero_()
    out[:, cb_pad:].copy_(s)
    return out


def unpack_rows(buf: torch.Tensor, rows: int, code_bytes: int, codes_dtype: torch.dtype, groups: int = -1):
    """``(codes [rows, code_bytes], scales [rows, groups] fp32)``: views of a received ``[rows, row]`` buffer (no
    copy: the kernels read rows at any stride). A row is a multiple of 4 bytes, so the scales view is aligned.
    ``groups``: scales per row (default: the rest of the row)."""
    b = buf.view(rows, -1)
    cb_pad = round_up(code_bytes, 4)
    end = b.shape[1] if groups < 0 else cb_pad + 4 * groups
    return b[:, :code_bytes].view(codes_dtype), b[:, cb_pad:end].view(torch.float32)
