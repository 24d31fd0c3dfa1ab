"""A byte-level text corpus with a deterministic split into training shards and a held-out shard.

Default text: the Python standard library's own ``*.py`` sources (about 30 MB on every machine that has Python,
nothing to download).  ``ByteCorpus(path)`` takes any text file or folder instead.

Tokens are bytes (vocabulary 256).  The split is by document (one file of a folder, or a 64 KiB block of a
single file), decided by a CRC-32 of the document's name, so it is the same on every machine, every process and
every Python version, and it does not depend on how many processes read it:

* held-out shard: about ``heldout_frac`` of the documents (used only for evaluation);
* training shards ``0 .. num_shards-1``: the other documents, each in exactly one shard.

When the text is too small for a split by document (a shard would be shorter than a few sequences), the byte
stream is split contiguously instead: the last ``heldout_frac`` is held out and the rest is cut into equal pieces.

Batches are drawn at random offsets inside a shard with a generator seeded by ``(seed, shard, step)``, so step
``t`` of shard ``k`` is the same set of sequences no matter which run (an island, a data-parallel baseline)
asks for it.
"""
import os
import sysconfig
import zlib

import numpy as np

VOCAB = 256
DOC_BLOCK = 64 * 1024           # a single large file is split into documents of this many bytes
SEPARATOR = b"\n\n"             # appended to every document so files do not run into each other
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git", ".hg", ".svn", "node_modules"}


def stdlib_dir():
    return sysconfig.get_paths()["stdlib"]


def _looks_like_text(path):
    with open(path, "rb") as f:
        head = f.read(8192)
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:  # a multi-byte character cut at the end of the probe is fine
        return e.start >= len(head) - 4
    return True


def list_documents(path=None):
    """[(name, absolute path)] in a fixed order. Default: the standard library's .py files."""
    if path is None:
        root, only_py = stdlib_dir(), True
    else:
        root, only_py = os.path.abspath(os.path.expanduser(path)), False
    if os.path.isfile(root):
        return [(os.path.basename(root), root)]
    if not os.path.isdir(root):
        raise FileNotFoundError(f"text path {path!r} is neither a file nor a folder")
    docs = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("."))
        for f in sorted(files):
            p = os.path.join(d, f)
            if f.startswith(".") or not os.path.isfile(p):
                continue
            if only_py and not f.endswith(".py"):
                continue
            if not only_py and not _looks_like_text(p):
                continue
            docs.append((os.path.relpath(p, root).replace(os.sep, "/"), p))
    if not docs:
        raise ValueError(f"no text files found under {root}")
    return docs


def _crc(name):
    return zlib.crc32(name.encode("utf-8", "surrogateescape"))


class ByteCorpus:
    def __init__(self, path=None, num_shards=2, heldout_frac=0.05, seed=0, min_shard_bytes=1 << 16):
        if num_shards < 1:
            raise ValueError("num_shards must be >= 1")
        if not 0.0 < heldout_frac < 0.5:
            raise ValueError("heldout_frac must be in (0, 0.5)")
        self.path = path
        self.source = stdlib_dir() if path is None else os.path.abspath(os.path.expanduser(path))
        self.num_shards, self.heldout_frac, self.seed = num_shards, heldout_frac, seed
        docs = list_documents(path)
        units = []  # (name, bytes)
        for name, p in docs:
            with open(p, "rb") as f:
                data = f.read()
            if len(docs) == 1 and len(data) > DOC_BLOCK:
                for off in range(0, len(data), DOC_BLOCK):
                    units.append((f"{name}@{off}", data[off: off + DOC_BLOCK]))
            elif data:
                units.append((name, data + SEPARATOR))
        self.num_documents = len(units)
        cut = int(round(heldout_frac * 10000))
        parts = {k: [] for k in ["heldout"] + list(range(num_shards))}
        for name, data in units:
            h = _crc(name)
            key = "heldout" if h % 10000 < cut else (h // 10000) % num_shards
            parts[key].append(data)
        arrays = {k: np.frombuffer(b"".join(v), dtype=np.uint8) for k, v in parts.items()}
        self.split = "by-document"
        if min(a.size for a in arrays.values()) < min_shard_bytes:
            stream = np.frombuffer(b"".join(d for _, d in units), dtype=np.uint8)
            n_held = max(int(stream.size * heldout_frac), 1)
            train = stream[: stream.size - n_held]
            arrays = {"heldout": stream[stream.size - n_held:]}
            per = train.size // num_shards
            for k in range(num_shards):
                arrays[k] = train[k * per: (k + 1) * per]
            self.split = "contiguous"
        self.heldout = arrays.pop("heldout")
        self.shards = [arrays[k] for k in range(num_shards)]

    def describe(self):
        return {"source": self.source, "documents": self.num_documents, "split": self.split,
                "shard_bytes": [int(s.size) for s in self.shards], "heldout_bytes": int(self.heldout.size)}

    def _check(self, arr, seq_len, what):
        if arr.size < seq_len + 2:
            raise ValueError(f"{what} has {arr.size} bytes, fewer than one sequence of {seq_len + 1}; "
                             f"use more text or a shorter --seq-length")

    def batch(self, shard, step, n, seq_len):
        """[n, seq_len + 1] int64 windows of training shard `shard` for step `step` (inputs = [:, :-1],
        labels = [:, 1:])."""
        arr = self.shards[shard]
        self._check(arr, seq_len, f"training shard {shard}")
        rng = np.random.default_rng([self.seed, shard, step])
        offs = rng.integers(0, arr.size - seq_len - 1, size=n)
        return np.stack([arr[o: o + seq_len + 1] for o in offs]).astype(np.int64)

    def global_batch(self, shards, step, global_batch, seq_len):
        """The global batch of a run that trains on `shards`: each shard gives global_batch / len(shards)
        sequences, shard-major. A data-parallel run over shards [0, 1] with twice the batch therefore sees
        exactly the tokens that two runs on shard 0 and shard 1 see."""
        if global_batch % len(shards):
            raise ValueError(f"global batch {global_batch} is not divisible by the {len(shards)} shards")
        per = global_batch // len(shards)
        return np.concatenate([self.batch(s, step, per, seq_len) for s in shards])

    def heldout_windows(self, n, seq_len):
        """[n, seq_len + 1] fixed, evenly spaced windows of the held-out shard (the same for every run)."""
        arr = self.heldout
        self._check(arr, seq_len, "the held-out shard")
        offs = np.linspace(0, arr.size - seq_len - 1, num=n).astype(np.int64)
        return np.stack([arr[o: o + seq_len + 1] for o in offs]).astype(np.int64)
