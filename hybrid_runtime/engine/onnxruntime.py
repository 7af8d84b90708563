"""onnxruntime (CPU) backend: one InferenceSession per segment (weights loaded once), IOBinding contexts.

Sessions share the process-wide intra-op thread pool and one memory arena (:mod:`.ort_session`). Output
buffers belong to the engine, not to each context: per profile there are two *banks*, flat storage for
the outputs of one segment at the profile's maximum token count (each output a contiguous ``[n, width]``
block of it), and segment ``i`` writes into bank ``i % 2``. A segment's outputs therefore stay valid
while the operator after it and the next segment run (which read them), and are overwritten by the
segment after that. Buffers per segment would hold every segment's prefill-sized outputs at once: about
240 MB more resident memory for the 334M benchmark model at 512-token chunks.
The embedding table is not part of the first segment's session: :mod:`.table_rows` splits its ``Gather``
out at load and the context reads the step's rows from the bundle file with ``pread`` into a buffer of its
own (a memory-mapped table put up to 2 MB per token into the resident set, 20-28 MB per decode step at
batch 16).
Each run binds only what changed (a decode step reusing the same buffers binds nothing); nothing is
allocated on the serving path.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..config import Manifest, ProfileSpec, SegmentSpec
from .base import PINNING_MODES, Engine, ExecutionContext, Phase
from .ort_session import Binding, FileMappings, cpu_session, session_options
from .table_rows import TableLookup, split_table_gathers

log = logging.getLogger("hybrid_runtime.engine")

Bank = np.ndarray  # flat float32 storage shared by the segments of one parity


# Output views are kept (the same objects every run: no rebinding) for steps of up to this many tokens, all made
# when a context is bound: made on first use, the tables of 256 sizes filled over hours of random prompt lengths
# (issue 21's soak: +6240 objects, +478 KB of the stub's traced heap in 105 minutes). Larger steps make theirs per run.
_VIEW_CACHE_TOKENS = 64


class OrtContext(ExecutionContext):
    """A segment bound to a profile through its own IOBinding, writing into a bank of output buffers."""

    def __init__(self, session: ort.InferenceSession, spec: SegmentSpec, profile: ProfileSpec, bank: Bank,
                 lookups: list[TableLookup] | None = None, max_tokens: int = 0) -> None:
        super().__init__(spec, profile)
        self.session = session
        self.binding = Binding(session)
        self._bank = bank
        # tables read outside the graph (table_rows): each with a row buffer for up to max_tokens tokens
        self._lookups = [(lk, lk.buffer(max_tokens or profile.max_tokens)) for lk in lookups or ()]
        self._no_bind = {lk.ids_input for lk in lookups or () if not lk.keep_ids}
        self._view_tables: dict[tuple[int, int], dict[int, dict[str, np.ndarray]]] = {}
        self.bind(profile, bank)

    def bind(self, profile: ProfileSpec, bank: Bank) -> None:
        """(Re)bind to ``profile``: outputs go to ``bank`` (sized to its max), every binding cleared."""
        self.profile = profile
        self.binding.clear()
        self._bank = bank
        # token count -> output views of the bank, made once per (bank, profile size) this context is bound to
        key = (id(bank), min(profile.max_tokens, _VIEW_CACHE_TOKENS))
        views = self._view_tables.get(key)
        if views is None:
            views = self._view_tables[key] = {n: self._make_views(n) for n in range(1, key[1] + 1)}
        self._views = views

    def _make_views(self, n: int) -> dict[str, np.ndarray]:
        """Each output a contiguous ``[n, width]`` block of the bank (``[n]`` for a width-0 output)."""
        outs, offset = {}, 0
        for name, dt, width in self.spec.outputs:
            size = n * max(width, 1)
            view = self._bank[offset:offset + size].view(np.dtype(dt)).reshape(n, max(width, 1))
            outs[name] = view if width else view[:, 0]
            offset += size
        return outs

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = self.check(inputs)
        b = self.binding
        for lk, buf in self._lookups:
            b.input(lk.rows_input, lk.read(np.asarray(inputs[lk.ids_input]), buf))
        for name, arr in inputs.items():
            if name not in self._no_bind:
                b.input(name, np.ascontiguousarray(arr))
        outs = self._views.get(n)
        if outs is None:  # a prefill size: made per run (one dict per token count seen would only grow)
            outs = self._make_views(n)
        for name, view in outs.items():
            b.output(name, view)
        b.run()
        return dict(outs)


class OrtEngine(Engine):
    """All segments of an onnxruntime bundle."""

    def __init__(self, bundle_dir: str | Path, manifest: Manifest, pinning: str = "per_context",
                 intra_op_threads: int = 0) -> None:
        if pinning not in PINNING_MODES:
            raise ValueError(f"profile_pinning={pinning!r}: choose one of {', '.join(PINNING_MODES)}")
        self.pinning = pinning
        self.profile_switches = 0
        self._specs = manifest.segments
        self._profiles = manifest.profiles
        # Workaround ort-cpu-extended-graph-opt (recorded in the manifest): session_options sets it.
        opts = session_options(intra_op_threads)
        self._banks = [[self._bank(p, parity) for parity in (0, 1)] for p in self._profiles]
        self._contexts: list[list[OrtContext]] = []
        widest = max(p.max_tokens for p in self._profiles)
        for i, spec in enumerate(self._specs):
            path = Path(bundle_dir) / spec.onnx
            split = split_table_gathers(path)  # the embedding table: rows read with pread (table_rows)
            if split is None:
                sess, lookups = cpu_session(path, opts), []
            else:
                model, lookups = split
                own = session_options(intra_op_threads)  # the other initializers' external data: next to it
                own.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
                sess = cpu_session(model, own)
                del model
            if pinning == "per_context":
                self._contexts.append([OrtContext(sess, spec, p, self._banks[k][i % 2], lookups)
                                       for k, p in enumerate(self._profiles)])
            else:
                self._contexts.append([OrtContext(sess, spec, self._profiles[Phase.PREFILL],
                                                  self._banks[Phase.PREFILL][i % 2], lookups, widest)])
        # What onnxruntime still maps of the bundle after prepacking: tables read a row at a time that
        # split_table_gathers left in their graph (none in the bundles this builder writes).
        self._mapped = FileMappings(Path(bundle_dir) / "segments")
        self._mapped.release()
        log.info("onnxruntime engine: %d segments, %d contexts (%s)", len(self._specs), self.num_contexts(), pinning)

    def _bank(self, profile: ProfileSpec, parity: int) -> Bank:
        """Storage for the outputs of any one segment of this parity at the profile's max token count.
        np.zeros maps untouched pages lazily: a bank costs memory only for what runs have written."""
        widest = max((sum(max(w, 1) for _, _, w in spec.outputs) for spec in self._specs[parity::2]), default=0)
        for spec in self._specs:
            if any(np.dtype(dt).itemsize != 4 for _, dt, _ in spec.outputs):
                raise ValueError(f"segment {spec.name}: outputs must be 4-byte types to share a bank")
        return np.zeros(profile.max_tokens * widest, np.float32)

    @property
    def segments(self) -> tuple[SegmentSpec, ...]:
        return self._specs

    def num_contexts(self) -> int:
        return sum(len(c) for c in self._contexts)

    def context(self, segment: int, phase: Phase) -> OrtContext:
        ctxs = self._contexts[segment]
        if self.pinning == "per_context":
            return ctxs[phase]
        ctx = ctxs[0]
        want = self._profiles[phase]
        if ctx.profile != want:
            ctx.bind(want, self._banks[phase][segment % 2])  # switch, then rebind every input and output
            self.profile_switches += 1
        return ctx

    def run(self, segment: int, phase: Phase, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.context(segment, phase).run(inputs)
        if segment == 0 and self._mapped.ranges:
            self._mapped.release()  # the rows just read stay in the page cache, not in this process
        return out
