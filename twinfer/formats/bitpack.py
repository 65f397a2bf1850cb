"""Bit packing shared by the formats: b-bit codes <-> a little-endian byte stream.
Code `i` of a row occupies bits `[i*b, (i+1)*b)` from the least significant bit of byte 0 (b = 4: low
nibble first); `pack_rows` zero-pads rows to whole groups of `code_group` codes."""

from __future__ import annotations

import math

import numpy as np


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint8 codes ``[..., n]`` (each ``< 2**bits``) into uint8 ``[..., n * bits / 8]``."""
    n = codes.shape[-1]
    if (n * bits) % 8:
        raise ValueError(
            f"cannot pack {n} codes of {bits} bits into whole bytes; pad the row to a multiple of 8"
        )
    if bits == 8:
        return np.ascontiguousarray(codes, dtype=np.uint8)
    shifts = np.arange(bits, dtype=np.uint8)
    planes = (codes.astype(np.uint8)[..., None] >> shifts) & 1  # [..., n, bits]
    return np.packbits(planes.reshape(*codes.shape[:-1], n * bits), axis=-1, bitorder="little")


def unpack_bits(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: uint8 ``[..., n * bits / 8]`` -> uint8 codes ``[..., n]``."""
    if bits == 8:
        return np.ascontiguousarray(packed[..., :n], dtype=np.uint8)
    planes = np.unpackbits(packed, axis=-1, count=n * bits, bitorder="little")
    planes = planes.reshape(*packed.shape[:-1], n, bits)
    weights = (1 << np.arange(bits)).astype(np.uint8)
    return (planes * weights).sum(axis=-1, dtype=np.uint8)


def code_group(bits: int) -> tuple[int, int]:
    """``(codes, bytes)`` of the shortest run of ``bits``-bit codes that fills whole bytes."""
    if not 1 <= bits <= 8:
        raise ValueError(f"codes of {bits} bits cannot be packed into bytes; use 1 to 8 bits")
    codes = 8 // math.gcd(bits, 8)
    return codes, codes * bits // 8


def packed_width(n: int, bits: int) -> int:
    """Bytes one row of ``n`` codes takes after :func:`pack_rows`."""
    codes, nbytes = code_group(bits)
    return -(-n // codes) * nbytes


def pack_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """:func:`pack_bits` for rows of any length ``n``: uint8 ``[..., packed_width(n, bits)]``.
    Each row is zero-padded to whole groups first; :func:`unpack_bits` with the row's ``n`` reads it back."""
    pad = -codes.shape[-1] % code_group(bits)[0]
    return pack_bits(np.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, pad)]), bits)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Two 4-bit codes per byte, even element in the low nibble: ``byte = c[2i] | c[2i+1] << 4``."""
    if codes.shape[-1] % 2:
        raise ValueError("the packed (last) dimension must be even to hold two 4-bit values per byte")
    c = codes.astype(np.uint8)
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_nibbles`: uint8 ``[..., m]`` -> 4-bit codes ``[..., 2m]``."""
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out
