"""What a replacement actor loads before it serves: every accepted push
since the checkpoint, composed into one push.

The live actors hold the checkpoint with each committed push applied over
it in order; a push may set only some tensors. A replacement starts from
the checkpoint too, so it must load, per tensor, the newest push that set
it: the last push alone would leave every tensor an earlier push set and the
last one did not at the checkpoint's value, under the last push's version.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .wire import Manifest, TensorEntry


@dataclass(frozen=True, slots=True)
class Published:
    """Every committed push since the checkpoint, as one push.

    `manifest` has, per tensor name, the entry of the newest push that set
    it, renumbered into `refs`: the object refs of the buckets that still
    hold a current tensor, kept alive here. Each bucket keeps its size and
    its entries their offsets, so a replacement receives and verifies it
    like any pushed bucket; bytes of tensors a later push replaced are
    simply not named by any entry. `version` is the newest push's.
    """

    manifest: Manifest
    version: int
    refs: tuple  # Ray object refs of the buckets, one per `manifest.bucket_nbytes`


def compose(
    previous: Published | None,
    manifest: Manifest,
    version: int,
    refs: tuple,
    aliases: Mapping[str, Iterable[str]] | None = None,
) -> Published:
    """`previous` with the push (`manifest`, `version`, bucket `refs`) applied over it.

    The push's entries replace those of the same names, and of the names
    `aliases` says the engine holds in the same weight (a tied
    `lm_head.weight` is the embedding): a push that sets the embedding
    under either name supersedes both, and the adapter entries an earlier
    push set on them (`name@lora.*`: the tensor's new value is its base
    now). A bucket none of whose entries is
    current any more is dropped, so the object store does not keep every
    push; a push of every tensor leaves nothing of the ones before it.
    """
    if len(refs) != len(manifest.bucket_nbytes):
        raise ValueError(f"a push of {len(manifest.bucket_nbytes)} buckets came with {len(refs)} refs")
    aliases = aliases or {}
    pushed = {e.name for e in manifest.entries}
    superseded = pushed | {other for name in pushed for other in aliases.get(name, ())}
    if previous is not None:  # a tensor set whole drops the adapter an earlier push set on it
        superseded |= {e.name for e in previous.manifest.entries if e.name.split("@", 1)[0] in superseded}
    # (bucket key, ref, bucket size, entry): a bucket is known by the push it came with and its index there.
    sources: list[tuple[tuple[int, int], object, int, TensorEntry]] = []
    if previous is not None:
        old = previous.manifest
        sources += [
            ((0, e.bucket), previous.refs[e.bucket], old.bucket_nbytes[e.bucket], e)
            for e in old.entries
            if e.name not in superseded
        ]
    sources += [((1, e.bucket), refs[e.bucket], manifest.bucket_nbytes[e.bucket], e) for e in manifest.entries]
    index: dict[tuple[int, int], int] = {}  # bucket key -> its index in the composed push, by first use
    kept_refs, sizes, entries = [], [], []
    for key, ref, size, entry in sources:
        if key not in index:
            index[key] = len(kept_refs)
            kept_refs.append(ref)
            sizes.append(size)
        entries.append(dataclasses.replace(entry, bucket=index[key]))
    return Published(Manifest(tuple(entries), tuple(sizes)), version, tuple(kept_refs))
