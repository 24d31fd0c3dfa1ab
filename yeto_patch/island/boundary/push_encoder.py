"""Encode a fragment's delta as it streams in, in bounded pieces, into the push body (wire.codecs layout).

The island's delta arrives on rank 0 in chunks (entry by entry, in layout order). Encoding needs the whole
fragment only for its final byte layout (block codecs put every block scale first, then the codes), not its
float32 values: each piece of whole blocks is encoded on its own and its scales and codes are copied to their
places in the body, which is bit-identical to encoding the whole vector at once. Memory: the body (what the
background sender must hold anyway) plus one staging piece, plus the error-feedback residual when on.
"""
from __future__ import annotations

import bisect
import math
from typing import Optional, Sequence

import numpy as np

from yeto_patch.wire import codec_names, codecs
from yeto_patch.wire.frames import CodecError


class PushBody(np.ndarray):
    """An encoded push (uint8, the wire layout) that knows the codec and block it was encoded with (they travel
    with it to the link and the sync state) and the L2 norm of the float32 delta it encodes (before error
    feedback is added and before quantization): ``delta_norm`` (None until encoded)."""
    delta_norm = None
    codec = None
    block = None


class PushEncoder:
    def __init__(self, codec: str, block: int, numel: int, *, piece_elems: int = 1 << 20,
                 residual: Optional[np.ndarray] = None, what: str = "fragment",
                 entry_starts: Sequence[int] = (), entry_names: Sequence[str] = ()):
        codecs.check_codec(codec, block)
        self.codec, self.block, self.numel = codec, int(block), int(numel)
        self.body = np.empty(codecs.encoded_nbytes(codec, numel, block), dtype=np.uint8).view(PushBody)
        self.body.codec, self.body.block = codec, self.block
        self.sumsq = 0.0      # of the delta's values fed so far
        unit = self.block if codec_names.is_blockwise(codec) else 2
        self.piece = max(unit, (int(piece_elems) // unit) * unit)
        self.buffer = np.empty(min(self.piece, max(numel, 1)), dtype=np.float32)
        self.fill = 0
        self.pos = 0          # elements encoded so far
        self.received = 0     # elements fed so far
        self.residual = residual
        if residual is not None and (residual.dtype != np.float32 or residual.size != numel):
            raise ValueError("error-feedback residual must be float32 of the fragment's size")
        self.what = what
        self.entry_starts, self.entry_names = list(entry_starts), list(entry_names)
        self.encode_s = 0.0

    def feed(self, arr: np.ndarray) -> None:
        a = np.asarray(arr, dtype=np.float32).reshape(-1)
        if self.received + a.size > self.numel:
            raise CodecError(f"{self.what}: more values than the fragment's {self.numel}")
        self.received += a.size
        i = 0
        while i < a.size:
            n = min(a.size - i, self.buffer.size - self.fill)
            self.buffer[self.fill:self.fill + n] = a[i:i + n]
            self.fill += n
            i += n
            if self.fill == self.buffer.size:
                self._emit()

    def finish(self) -> np.ndarray:
        if self.fill:
            self._emit()
        if self.pos != self.numel:
            raise CodecError(f"{self.what}: got {self.pos} values, the fragment has {self.numel}")
        if math.isfinite(self.sumsq):
            self.body.delta_norm = math.sqrt(self.sumsq)
        return self.body

    def _names(self, a: int, b: int) -> str:
        if not self.entry_starts:
            return ""
        i = max(0, bisect.bisect_right(self.entry_starts, a) - 1)
        j = max(0, bisect.bisect_left(self.entry_starts, b) - 1)
        names = self.entry_names[i:j + 1]
        return " (" + ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "") + ")"

    def _emit(self) -> None:
        import time
        t0 = time.perf_counter()
        x = self.buffer[:self.fill]
        n, pos = x.size, self.pos
        self.sumsq += float(np.dot(x, x))
        if self.residual is not None:
            x += self.residual[pos:pos + n]
        try:
            enc = codecs.encode(self.codec, x, self.block, name=f"{self.what}{self._names(pos, pos + n)}")
        except CodecError as e:
            raise CodecError(f"{e}: the local model holds NaN/inf; refusing to push it") from None
        if self.residual is not None:
            self.residual[pos:pos + n] = x - codecs.decode(self.codec, enc, n, self.block)
        codecs.splice(self.codec, self.body.view(np.ndarray), enc, pos, n, self.numel, self.block)
        self.pos += n
        self.fill = 0
        self.encode_s += time.perf_counter() - t0
