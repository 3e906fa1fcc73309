"""SGLang: patch every TP rank in place through Bulletin's weight loader, or reload a folder.

Written against SGLang 0.5.23 (sgl-project/sglang, ``python/sglang/srt/``; docs/ENGINES.md
cites each file). Two ways for a version to reach the server:

**In place** (:class:`SGLangInPlaceTarget`, the default when the server runs Bulletin's
loader): start SGLang with ``--custom-weight-loader bulletin.engines.sglang_loader.apply``
(:mod:`bulletin.engines.sglang_loader`). Each Bulletin request is one
``POST /update_weights_from_tensor`` with ``load_format`` naming the loader, inside a
weight-update session (``/begin_weight_update`` ... ``/end_weight_update``, required by
0.5.23's scheduler): SGLang calls the loader on every TP rank, under its own
``model_update_lock`` (or at once while generation is paused), and each rank writes its
result into a reply folder of the spool; the patch itself travels as Bulletin shard
files in that spool (same machine). A version is applied while generation is paused
(``/pause_generation {"mode": "abort"}``: requests that outlived the sidecar's drain end
with finish reason ``abort``, new ones wait), checked on every rank against the
partial fingerprints it must land on (with tensor parallelism each rank holds pieces of
the checkpoint's tensors, its :class:`~bulletin.engines.rank_layout.RankLayout`; the
ranks' partials are planned from the verified folder and summed with
:class:`~bulletin.engines.rank_layout.ReplicaPlan`, see :class:`SGLangInPlaceTarget`),
and activated by a last loader call with ``flush_cache``
and ``weight_version``: SGLang itself then flushes the radix cache and records
Bulletin's version as its own label; ``/continue_generation`` ends the pause. Any
failure puts every rank back (each keeps the previous bits until activation) and the
folder too. With pipeline stages every stage's TP ranks run each call, the later ones
after SGLang has answered it (stage 0's): their replies are waited for
(:mod:`bulletin.engines.sglang_loader`). SGLang refuses ``/update_weights_from_tensor``
with data-parallel replicas (``dp_size > 1``: an assertion in
``managers/tokenizer_control_mixin.py``), so such servers are served from disk.

**From disk** (:class:`SGLangTarget`): the folder is patched and SGLang reloads it::

    POST /update_weights_from_disk
    {"model_path": "<folder of safetensors>", "weight_version": "<label>",
     "abort_all_requests": true, "load_format": null}
    -> 200 {"success": true,  "message": "...", "num_paused_requests": 0}
    -> 400 {"success": false, "message": "..."}

and reports the label in ``GET /model_info`` (``weight_version``; older servers:
``GET /get_weight_version``). The model's architecture and config stay those the server
was started with; the folder only has to hold the weights (Bulletin keyframes are plain
safetensors plus an HF index). Where the server also runs Bulletin's loader, what it
loaded is read back from every rank and must match the version's fingerprints before
activation; otherwise SGLang's own checksum (``/weights_checker``) is what is checked.

A refused reload does not mean the server still holds the old weights: SGLang sets the
new folder as its model path *before* loading, loads tensor by tensor into the live
parameters, and on an exception "rolls back" by loading that same new folder again
(``model_runner_components/weight_updater.py``); with several data-parallel engines some
may have loaded and others not; and a reload whose cache flush is refused answers
``success: false`` with the new weights in place (``scheduler_components/
weight_updater.py``). So after any failed reload :class:`SGLangTarget` puts the folder
back, reloads the committed version into the server and checks it (success, its radix
cache flushed, the fingerprints read back where the loader runs, and SGLang's per-rank
weight checksums equal to those recorded when that version was last loaded and equal
across data-parallel ranks). If that fails too, the engine's bits are unknown:
:meth:`SGLangTarget.full_fingerprints` answers with no fingerprints until a version is
loaded again, so the sidecar's verification withdraws the version and rebuilds it from
a keyframe.

:func:`open_sglang` picks the mode (``auto``: in place where the server lists the
loader and has no data-parallel replicas).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from bulletin.engines.http import engine_url, request_json
from bulletin.engines.rank_layout import RankLayout, ReplicaPlan, with_dropped
from bulletin.engines.sglang_loader import LOADER, REQUEST_FORMAT, STAGED_REQUEST_FORMAT, encode_requests, reply_path
from bulletin.engines.wire import ERRORS, SPOOL_SHARD_BYTES, fps_from_json, fps_to_json, specs_to_json
from bulletin.errors import (
    BulletinError,
    ConfigError,
    EngineError,
    IncompatibleLayout,
    VerificationFailed,
)
from bulletin.target import Held, LocalDirTarget, WeightTarget
from patcher.fingerprint import fingerprint, format_fingerprint
from patcher.patch import Patch, TensorSpec

__all__ = ["MODES", "SGLangInPlaceTarget", "SGLangTarget", "open_sglang"]

Bits = NDArray[np.unsignedinteger]
log = logging.getLogger("bulletin.engines.sglang")

#: ``bulletin serve --sglang-mode`` values.
MODES: Final = ("auto", "inplace", "disk")
#: How often a reply of a later pipeline stage is looked for once SGLang has answered.
_REPLY_POLL_S: Final = 0.005


def _request(
    method: str,
    body: Mapping[str, Any],
    rank: int,
    ranks: int,
    stages: int,
    reply: str,
    per_rank: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """TP rank ``rank``'s request, which every pipeline stage's rank ``rank`` reads."""
    own = [per_rank[s * ranks + rank] if per_rank is not None else {} for s in range(stages)]
    request: dict[str, Any] = {"method": method, "rank": rank, "ranks": ranks, "reply": reply}
    if stages == 1:  # format 1, which loaders before pipeline stages read
        return {"bulletin": REQUEST_FORMAT, **request, "body": {**body, **own[0]}}
    return {"bulletin": STAGED_REQUEST_FORMAT, **request, "body": dict(body), "stages": stages, "per_stage": own}


class _SGLangServer(WeightTarget):
    """What both modes share: SGLang's control endpoints and calls into Bulletin's loader."""

    def __init__(
        self,
        local: LocalDirTarget,
        url: str,
        *,
        timeout: float = 600.0,
        spool_dir: str | Path | None = None,
        loader: str = LOADER,
    ) -> None:
        self.local = local
        self.url = engine_url(url)
        self.timeout = timeout
        self.loader = loader
        self.spool_dir = Path(spool_dir) if spool_dir is not None else local.dir / "spool"
        self._info: dict[str, Any] | None = None
        #: Served tensors the engine does not hold (``engine_drops``), per binding.
        self.dropped: frozenset[str] = frozenset()
        #: The TP ranks' layouts, per binding: whose partial fingerprints make up each tensor's.
        self.plan: ReplicaPlan | None = None

    # -- HTTP ------------------------------------------------------------------------------

    def _post(self, path: str, payload: Any = None, *, what: str, timeout: float | None = None) -> Any:
        status, body = request_json("POST", f"{self.url}{path}", payload, timeout=timeout or self.timeout, text=True)
        success = not isinstance(body, dict) or body.get("success", True) is not False
        if status != 200 or not success:
            message = body.get("message") if isinstance(body, dict) else body
            raise EngineError(f"SGLang {what} failed (HTTP {status}): {message!s:.500}")
        return body

    def server_info(self) -> dict[str, Any]:
        """``GET /server_info`` (the launch settings: ``tp_size``, ``dp_size``,
        ``custom_weight_loader``, ...), asked once."""
        if self._info is None:
            status, body = request_json("GET", f"{self.url}/server_info", timeout=min(self.timeout, 60.0))
            if status == 404:
                status, body = request_json("GET", f"{self.url}/get_server_info", timeout=min(self.timeout, 60.0))
            if status == 404:
                body = {}  # a server too old to report them: it has none of what is asked
            elif status != 200 or not isinstance(body, dict):
                raise EngineError(f"SGLang did not report its settings (HTTP {status})")
            self._info = body
        return self._info

    def loader_refusal(self) -> str | None:
        """Why Bulletin's loader cannot be called on this server, or None if it can."""
        info = self.server_info()
        loaders = info.get("custom_weight_loader") or []
        if self.loader not in loaders:
            return f"SGLang was not started with --custom-weight-loader {self.loader}"
        if int(info.get("dp_size") or 1) != 1:
            return "SGLang refuses /update_weights_from_tensor with data-parallel replicas (dp_size > 1)"
        return None

    def _size(self, key: str) -> int:
        size = self.server_info().get(key) or 1
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise EngineError(f"SGLang reports {key} {size!r}")
        return size

    def ranks(self) -> int:
        """TP ranks of each pipeline stage."""
        return self._size("tp_size")

    def stages(self) -> int:
        """Pipeline stages of the engine: one loader reply per TP rank of each."""
        return self._size("pp_size")

    def engine_version(self) -> str | None:
        """The ``weight_version`` SGLang reports (``GET /model_info``; ``GET
        /get_weight_version`` on servers before it)."""
        status, body = request_json("GET", f"{self.url}/model_info", timeout=30.0)
        if status == 404:
            status, body = request_json("GET", f"{self.url}/get_weight_version", timeout=30.0)
        if status != 200 or not isinstance(body, dict):
            raise EngineError(f"SGLang did not report its weight version (HTTP {status})")
        value = body.get("weight_version")
        return None if value is None else str(value)

    def label(self, version: int) -> None:
        """Set SGLang's weight version label (``/update_weight_version``)."""
        self._post("/update_weight_version", {"new_version": str(version)}, what="update_weight_version")

    def flush(self, version: int) -> None:
        status, body = request_json("POST", f"{self.url}/flush_cache", timeout=min(self.timeout, 60.0), text=True)
        if status != 200:
            raise EngineError(f"SGLang loaded version {version} but did not flush its radix cache: {body!r:.200}")

    @contextlib.contextmanager
    def _session(self) -> Iterator[None]:
        """A weight-update session around loader calls (0.5.23's scheduler refuses them
        outside one; servers without ``/begin_weight_update`` need none)."""
        status, body = request_json("POST", f"{self.url}/begin_weight_update", {}, timeout=self.timeout)
        if status == 404:
            yield
            return
        if status != 200 and "already open" in str(body):
            # A session a crashed sidecar left open: close it and open ours.
            self._post("/end_weight_update", {}, what="end_weight_update")
            status, body = request_json("POST", f"{self.url}/begin_weight_update", {}, timeout=self.timeout)
        if status != 200:
            raise EngineError(f"SGLang begin_weight_update failed (HTTP {status}): {body!r:.200}")
        try:
            yield
        finally:
            self._post("/end_weight_update", {}, what="end_weight_update")

    def call(
        self,
        method: str,
        body: Mapping[str, Any],
        *,
        per_rank: list[dict[str, Any]] | None = None,
        flush: bool = False,
        weight_version: str | None = None,
    ) -> list[dict[str, Any]]:
        """Run ``method`` on every rank through the loader; one ok result per rank, stage
        by stage (result ``s * tp + r`` is TP rank ``r`` of pipeline stage ``s``).

        ``per_rank[i]`` is merged into that rank's body (each rank unpickles only its own
        request: TP rank ``r``'s entry carries every stage's part). ``flush`` and
        ``weight_version`` are passed to ``/update_weights_from_tensor``: SGLang flushes
        its radix cache and records the label after the ranks return (the loader cannot
        fail SGLang's call, so only pass them for a step that the ranks cannot refuse,
        or undo the label on a refusal). SGLang answers once stage 0 ran the call; the
        later stages' replies are waited for, up to the timeout."""
        ranks, stages = self.ranks(), self.stages()
        if per_rank is not None and len(per_rank) != ranks * stages:
            raise EngineError(f"{len(per_rank)} rank bodies for {ranks} TP ranks x {stages} pipeline stages")
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        folder = self.spool_dir / f"call-{secrets.token_hex(8)}"
        folder.mkdir()
        try:
            requests = [_request(method, body, r, ranks, stages, str(folder), per_rank) for r in range(ranks)]
            payload = {
                "serialized_named_tensors": encode_requests(requests),
                "load_format": self.loader,
                "flush_cache": flush,
                "abort_all_requests": False,
                "weight_version": weight_version,
            }
            with self._session():
                self._post("/update_weights_from_tensor", payload, what=f"loader call {method}")
            # Stage 0's ranks ran before SGLang answered; a later stage's may still run.
            later = time.monotonic() + self.timeout
            return [self._reply(folder, s, r, method, later if s else 0.0) for s in range(stages) for r in range(ranks)]
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @staticmethod
    def _reply(folder: Path, stage: int, rank: int, method: str, deadline: float) -> dict[str, Any]:
        path = reply_path(folder, rank, stage)
        who = f"SGLang TP rank {rank}" + (f" of pipeline stage {stage}" if stage else "")
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(_REPLY_POLL_S)
        try:
            result = json.loads(path.read_text())
        except FileNotFoundError:
            raise EngineError(
                f"{who} did not answer {method} (no {path.name}): is the spool folder on the "
                "engine's machine, and the loader importable there?"
            ) from None
        except (OSError, json.JSONDecodeError) as exc:
            raise EngineError(f"{who} answered {method} unreadably: {exc}") from None
        if not isinstance(result, dict):
            raise EngineError(f"{who} answered {method} with {result!r:.200}")
        if result.get("ok") is not True:
            cls = ERRORS.get(str(result.get("code")), EngineError)
            error = cls(f"{who}: {result.get('message')}")
            error.details = result  # type: ignore[attr-defined]
            raise error
        return result

    def _bind(self, specs: Mapping[str, TensorSpec]) -> None:
        """Bind every rank to ``specs`` (rebinding: a reload may have replaced parameters)
        and plan whose partials make up each tensor (``IncompatibleLayout`` if the ranks'
        pieces overlap, leave elements uncovered or are not those of ranks 0 .. tp-1)."""
        results = self.call("bind", {"specs": specs_to_json(specs)})
        layouts = [RankLayout.from_json(r.get("layout")) for r in results]
        tp = self.ranks()
        for i, layout in enumerate(layouts):
            stage, r = divmod(i, tp)
            if (layout.pp_rank, layout.tp_rank, layout.tp_size) != (stage, r, tp):
                raise IncompatibleLayout(
                    f"SGLang TP rank {r} of {tp} (pipeline stage {stage}) holds the pieces of TP rank "
                    f"{layout.tp_rank} of {layout.tp_size} (pipeline stage {layout.pp_rank}); attention data "
                    "parallelism?"
                )
        plan = ReplicaPlan(layouts, specs)
        if plan.dropped and plan.dropped != self.dropped:
            log.info(
                "%d served tensors are not engine parameters (kept in the folder only): %s",
                len(plan.dropped),
                sorted(plan.dropped)[:5],
            )
        self.plan, self.dropped = plan, plan.dropped

    def _served(self, fps: Mapping[str, int]) -> dict[str, int]:
        return {n: fp for n, fp in fps.items() if n not in self.dropped}

    def _partials(self, results: list[dict[str, Any]]) -> list[dict[str, int]]:
        return [fps_from_json(r.get("fingerprints")) for r in results]

    def _engine_fingerprints(self) -> dict[str, int]:
        """Each bound tensor's fingerprint, summed from the ranks' partial fingerprints. A
        tensor whose replicas disagree (a rank holding other bits than another for the
        same elements) is left out: held by the engine in no exact version."""
        if self.plan is None:
            raise EngineError("SGLang's ranks are not bound to a layout")
        return _combine(self.plan, self._partials(self.call("fingerprints", {})), strict=False)

    # -- delegated to the folder -----------------------------------------------------------

    def layout(self) -> Mapping[str, TensorSpec] | None:
        return self.local.layout()

    def context_bits(self) -> Mapping[str, Bits] | None:
        # The folder holds what the engine serves: context-coded patches decode against it.
        return self.local.context_bits()

    def close(self) -> None:
        self.local.close()


def _combine(plan: ReplicaPlan, partials: list[dict[str, int]], *, strict: bool) -> dict[str, int]:
    """Each tensor's fingerprint from the ranks' partials (:meth:`ReplicaPlan.combine`);
    where replicas disagree, ``VerificationFailed`` (``strict``) or the tensor left out."""
    try:
        return plan.combine(partials)
    except VerificationFailed:
        if strict:
            raise
    out: dict[str, int] = {}
    for name in plan.sets:
        try:
            out.update(plan.combine(partials, names=[name]))
        except VerificationFailed as exc:
            log.warning("SGLang's ranks disagree: %s", exc)
    return out


def _check_ranks(plan: ReplicaPlan, got: list[dict[str, int]], expected: list[dict[str, int]], what: str) -> None:
    """Every rank reported the partials it must hold; ``VerificationFailed`` naming the
    first rank and tensors that did not."""
    for r, (have, want) in enumerate(zip(got, expected, strict=True)):
        bad = sorted(n for n in have.keys() | want.keys() if have.get(n) != want.get(n))
        if bad:
            raise VerificationFailed(
                f"SGLang TP rank {plan.layouts[r].key} {what} for {len(bad)} tensor(s): {bad[:3]} "
                f"({[format_fingerprint(have[n]) if n in have else None for n in bad[:3]]})"
            )


class SGLangInPlaceTarget(_SGLangServer):
    """A :class:`~bulletin.target.WeightTarget` patching an SGLang server's ranks in place.

    ``local`` is the folder SGLang was started from (``--model-path <dir>/current``), kept
    verified as what a restarted server loads; ``spool_dir`` (default ``<local>/spool``)
    must be readable and writable by SGLang's ranks (same machine). The server must run
    Bulletin's loader (:data:`~bulletin.engines.sglang_loader.LOADER`).

    With tensor parallelism every rank holds pieces of the checkpoint's tensors (its
    :class:`~bulletin.engines.rank_layout.RankLayout`) and reports *partial*
    fingerprints over them. The partials each rank must hold are computed here from the
    verified folder (once, then advanced by each patch in O(changed elements)), their
    sum per tensor checked against the manifest's fingerprints before anything is sent
    (:meth:`ReplicaPlan.combine`), sent to each rank as the base and target of its part
    of the patch, and what the ranks report is checked rank by rank and summed again
    before activation.
    """

    #: The ranks' parameters change during ``load_full`` and ``apply``.
    in_place = True
    #: A load overwrites the parameters, which keep no copy of what they held.
    restores_loads = False

    def __init__(self, local: LocalDirTarget, url: str, **kwargs: Any) -> None:
        super().__init__(local, url, **kwargs)
        self._bound_specs: dict[str, TensorSpec] | None = None
        #: Fingerprints of what every rank was last shown to hold (engine tensors only).
        self._engine_fps: dict[str, int] | None = None
        #: Per rank: the partials of the folder's committed version (None: not computed
        #: yet), and those of a loaded or applied version not yet activated.
        self._held_partials: list[dict[str, int]] | None = None
        self._staged_partials: list[dict[str, int]] | None = None
        self._paused = False

    def pause(self) -> None:
        """Stop generation before bits change (``mode=abort``: requests still running,
        which outlived the sidecar's drain, end with finish reason ``abort``; new ones
        wait in SGLang until :meth:`resume`)."""
        if not self._paused:
            self._post("/pause_generation", {"mode": "abort"}, what="pause_generation")
            self._paused = True

    def resume(self) -> None:
        if self._paused:
            self._post("/continue_generation", {}, what="continue_generation")
            self._paused = False

    def _bind_once(self, specs: Mapping[str, TensorSpec]) -> ReplicaPlan:
        # Ranks keep their undo state across calls: rebind only when the layout changes.
        if self._bound_specs != dict(specs) or self.plan is None:
            self._bound_specs = None
            self._bind(specs)
            self._bound_specs = dict(specs)
            self._held_partials = self._staged_partials = None
        assert self.plan is not None
        return self.plan

    def _base_partials(self) -> tuple[ReplicaPlan, list[dict[str, int]]] | None:
        """The plan and each rank's partials of the version held: a version loaded and
        not yet activated, or the folder's committed one (hashed once per binding, from
        the verified folder). None while nothing is held."""
        if self._staged_partials is not None and self.plan is not None:
            return self.plan, self._staged_partials
        specs, bits = self.local.layout(), self.local.context_bits()
        if specs is None or bits is None:
            return None
        plan = self._bind_once(specs)
        if self._held_partials is None:
            self._held_partials = plan.expected(bits)
        return plan, self._held_partials

    def restored(self) -> Held | None:
        """The folder's verified version, if every rank demonstrably holds the same bits
        (SGLang's label is then set to it)."""
        restored = self.local.restored()
        specs = self.local.layout()
        if restored is None or specs is None:
            return None
        try:
            self._bind_once(specs)
            engine = self._engine_fingerprints()
        except EngineError:
            raise  # unreachable or broken engine: say so instead of reloading blindly
        except BulletinError as exc:
            log.warning("SGLang's ranks do not hold version %d's layout: %s", restored.version, exc)
            return None  # its parameters do not hold this layout: start from a keyframe
        if engine != self._served(restored.fingerprints):
            log.warning(
                "SGLang does not hold version %d of %s; loading a keyframe into it", restored.version, self.local.dir
            )
            return None
        self._engine_fps = engine
        if self.engine_version() != str(restored.version):
            self.label(restored.version)
        # A sidecar that stopped between an apply and its activation left generation
        # paused (on purpose: the bits were not verified); they are now.
        self._paused = True
        self.resume()
        return restored

    def load_full(self, tensors: Mapping[str, Bits], specs: Mapping[str, TensorSpec]) -> None:
        self.local.load_full(tensors, specs)
        self._engine_fps = self._staged_partials = None  # the ranks' bits are the load's, or a mix
        plan = self._bind_once(specs)
        expected = plan.expected(tensors)
        fps = plan.combine(expected)  # the keyframe's fingerprints: each element hashed once
        self.pause()
        # Every rank copies its pieces from the folder and reads them back from its live
        # parameters: each must hold exactly its partials before activation.
        got = self._partials(self.call("load", {"path": str(self.local.staged_path)}))
        _check_ranks(plan, got, expected, "did not load the keyframe bit for bit")
        if plan.combine(got) != fps:
            raise VerificationFailed("SGLang's ranks did not load the keyframe bit for bit")
        self._engine_fps, self._staged_partials = fps, expected

    def apply(self, patch: Patch, fingerprints: Mapping[str, int]) -> dict[str, int]:
        from patcher.encode import encode

        held = self._base_partials()  # before the folder changes: its bits are the base
        new = self.local.apply(patch, fingerprints)  # checks the base and the layout first
        stem = self.spool_dir / f"apply-{secrets.token_hex(8)}"
        try:
            assert held is not None  # the folder just applied a patch onto what it holds
            plan, base = held
            if plan.combine(base) != self._served(fingerprints):
                self._held_partials = None
                raise VerificationFailed("the ranks' partials of the folder do not sum to the version held")
            served = Patch({n: td for n, td in patch.tensors.items() if n not in self.dropped})
            bits = self.local.context_bits()
            assert bits is not None  # the folder was just patched
            expected = plan.advance(base, served, bits)
            if plan.combine(expected) != self._served(new):
                raise VerificationFailed("the ranks' partials after the patch do not sum to the manifest's")
            stem.mkdir(parents=True)
            paths = []
            for i, shard in enumerate(encode(served, max_shard_bytes=SPOOL_SHARD_BYTES, codec="lz4")):
                path = stem / f"{i:05d}.bpatch"
                path.write_bytes(shard)
                paths.append(str(path.resolve()))
            # Each rank gets its own partials before and after (one per piece it holds).
            per_rank = [{"base": fps_to_json(b), "expect": fps_to_json(e)} for b, e in zip(base, expected, strict=True)]
            self.pause()
            got = self._partials(self.call("apply", {"shards": paths}, per_rank=per_rank))
            _check_ranks(plan, got, expected, "landed on other bits than the folder")
            if plan.combine(got) != self._served(new):
                raise VerificationFailed("SGLang's ranks landed on other bits than the folder")
            self._engine_fps, self._staged_partials = self._served(new), expected
        except BaseException:
            self._abort_engine()
            self.local.abort()
            raise
        finally:
            shutil.rmtree(stem, ignore_errors=True)
        return new

    def _abort_engine(self) -> None:
        # A rank whose apply failed has already put its own bits back; what the engine
        # holds afterwards is checked by the caller (the sidecar verifies it).
        with contextlib.suppress(BulletinError):
            self.call("abort", {})
        self._engine_fps = self._staged_partials = None
        with contextlib.suppress(BulletinError):
            self.resume()

    def abort(self) -> None:
        self._abort_engine()
        self.local.abort()

    def full_fingerprints(self) -> dict[str, int]:
        # The ranks' layout is the one loaded last, which the folder reports only once it
        # is activated. Tensors the engine drops are the folder's.
        specs = self._bound_specs if self._bound_specs is not None else self.local.layout()
        if specs is None:
            return {}
        self._bind_once(specs)
        return with_dropped(self._engine_fingerprints(), self.dropped, self.local.full_fingerprints)

    def activate(self, version: int, *, manifest_digest: str | None = None) -> None:
        """Check every rank once more with SGLang flushing its radix cache and taking
        ``version`` as its label in the same call, commit the ranks, resume."""
        expect, staged = self._engine_fps, self._staged_partials
        held = self.local.restored()
        try:
            if expect is None or staged is None or self.plan is None:
                raise EngineError("nothing verified to activate on SGLang's ranks")
            results = self.call("fingerprints", {}, flush=True, weight_version=str(version))
            got = self._partials(results)
            _check_ranks(self.plan, got, staged, "holds other bits than verified")
            if self.plan.combine(got) != expect:
                raise VerificationFailed("SGLang's ranks hold other bits than verified")
            self.call("activate", {"version": version})
            self.resume()
        except BaseException:
            self.abort()  # ranks and folder back on the version held before
            if held is not None:
                with contextlib.suppress(BulletinError):
                    self.label(held.version)  # SGLang took the label even if a rank refused
            raise
        self.local.activate(version, manifest_digest=manifest_digest)
        self._held_partials, self._staged_partials = staged, None


class SGLangTarget(_SGLangServer):
    """A :class:`~bulletin.target.WeightTarget` for an SGLang server that reloads ``local``.

    ``local`` is the folder SGLang was launched from (``--model-path <dir>/current``) or
    will reload from. ``timeout`` bounds one reload (large models take minutes).
    ``abort_all_requests`` (default True) is passed to every reload: the sidecar has
    already drained its requests for up to its drain timeout, so this only ends those
    that outlived it, with SGLang's ``abort`` finish reason, instead of letting them
    run on across the weight change. ``readback``: read the loaded weights' fingerprints
    back from every rank through Bulletin's loader (None: where the server runs it).
    """

    #: The engine's weights change only at ``activate`` (the reload).
    in_place = False

    def __init__(
        self,
        local: LocalDirTarget,
        url: str,
        *,
        timeout: float = 600.0,
        abort_all_requests: bool = True,
        load_format: str | None = None,
        readback: bool | None = None,
        spool_dir: str | Path | None = None,
        loader: str = LOADER,
    ) -> None:
        super().__init__(local, url, timeout=timeout, spool_dir=spool_dir, loader=loader)
        self.abort_all_requests = abort_all_requests
        self.load_format = load_format
        self.readback = readback
        #: SGLang's checksum of the weights it loaded for the committed version (None:
        #: not recorded yet, or the server has no ``/weights_checker``).
        self.engine_checksum: str | None = None
        #: Why the engine's bits are unknown (a failed reload that could not be undone).
        self.lost: str | None = None
        self._staged: tuple[dict[str, TensorSpec], dict[str, int]] | None = None

    # -- delegated to the folder -----------------------------------------------------------

    def restored(self) -> Held | None:
        return self.local.restored()

    def load_full(self, tensors: Mapping[str, Bits], specs: Mapping[str, TensorSpec]) -> None:
        self.local.load_full(tensors, specs)
        self._staged = (dict(specs), {n: fingerprint(tensors[n]) for n in specs})

    def apply(self, patch: Patch, fingerprints: Mapping[str, int]) -> dict[str, int]:
        new = self.local.apply(patch, fingerprints)
        self._staged = (patch.specs, dict(new))
        return new

    def full_fingerprints(self) -> dict[str, int]:
        """The folder's bits, which the engine loaded, unless a failed reload left the
        engine's bits unknown: then none, so that a verification finds every tensor
        damaged and rebuilds the version from a keyframe."""
        if self.lost is not None:
            log.warning("SGLang's weights are unknown (%s); reporting no fingerprints", self.lost)
            return {}
        return self.local.full_fingerprints()

    def abort(self) -> None:
        self._staged = None
        self.local.abort()

    # -- the engine ------------------------------------------------------------------------

    def activate(self, version: int, *, manifest_digest: str | None = None) -> None:
        """Reload SGLang from the folder now holding ``version``, check what it loaded,
        then commit the folder.

        If the reload fails, the folder is put back to its committed version and that
        version is reloaded into SGLang and checked (see the module docstring).
        """
        staged, self._staged = self._staged, None
        try:
            self.reload(self.local.staged_path, version)
            if staged is not None:
                self.read_back(*staged)
            checksum = self.checksum()
        except BaseException as exc:
            self.local.abort()
            self._restore(exc)
            raise
        self.local.activate(version, manifest_digest=manifest_digest)
        self.engine_checksum = checksum
        self.lost = None

    def _restore(self, cause: BaseException) -> None:
        """After a failed reload: the committed version back into SGLang, checked."""
        held = self.local.restored()
        model_path = self.local.model_path
        specs = self.local.layout()
        if held is None or model_path is None or specs is None:
            self.lost = f"a reload failed and no version is committed to restore ({cause})"
            return
        try:
            self.reload(model_path.resolve(), held.version)
            self.read_back(specs, held.fingerprints)
            checksum = self.checksum()
            if None not in (checksum, self.engine_checksum) and checksum != self.engine_checksum:
                raise EngineError(
                    f"SGLang reloaded version {held.version} with weight checksum {checksum}, "
                    f"not {self.engine_checksum} as before"
                )
        except BulletinError as exc:
            self.lost = f"a reload failed ({cause}) and reloading version {held.version} failed too ({exc})"
            log.error("%s", self.lost)
            return
        log.warning("SGLang is back on version %d after a failed reload: %s", held.version, cause)

    def _reads_back(self) -> bool:
        if self.readback is None:
            refusal = self.loader_refusal()
            self.readback = refusal is None
            if refusal is not None:
                log.info("SGLang's loads are checked by its own checksum only: %s", refusal)
        return self.readback

    def read_back(self, specs: Mapping[str, TensorSpec], expect: Mapping[str, int]) -> None:
        """Read the fingerprints of what SGLang loaded back from every rank, through
        Bulletin's loader; ``VerificationFailed`` unless they are ``expect``'s (tensors
        the engine does not serve aside). Nothing where the loader does not run."""
        if not self._reads_back():
            return
        self._bind(specs)  # a reload may have replaced parameters: bind afresh
        engine = self._engine_fingerprints()  # the ranks' partials, summed per tensor
        bad = sorted(n for n in engine.keys() | self._served(expect).keys() if engine.get(n) != expect.get(n))
        if bad:
            raise VerificationFailed(f"SGLang loaded other bits than the folder for {len(bad)} tensor(s): {bad[:3]}")

    def reload(self, folder: Path, version: int) -> None:
        """``POST /update_weights_from_disk`` with ``folder``, then ``/flush_cache``;
        ``EngineError`` unless both succeeded."""
        payload: dict[str, Any] = {
            "model_path": str(folder),
            "weight_version": str(version),
            "abort_all_requests": self.abort_all_requests,
        }
        if self.load_format is not None:
            payload["load_format"] = self.load_format
        endpoint = f"{self.url}/update_weights_from_disk"
        status, body = request_json("POST", endpoint, payload, timeout=self.timeout)
        success = isinstance(body, dict) and body.get("success") is True
        if status != 200 or not success:
            message = body.get("message") if isinstance(body, dict) else body
            raise EngineError(f"SGLang refused to load version {version} from {folder} (HTTP {status}): {message}")
        # SGLang >= 0.5.5 flushes the radix cache inside the reload (and fails the reload
        # when it cannot); older servers do not: flush explicitly either way, so that no
        # KV computed with the old weights is reused.
        self.flush(version)

    def checksum(self) -> str | None:
        """SGLang's own checksum of the weights it holds (``/weights_checker``), after
        checking that every data-parallel copy of each rank holds the same; None where the
        server has no such endpoint."""
        status, body = request_json(
            "POST", f"{self.url}/weights_checker", {"action": "checksum"}, timeout=min(self.timeout, 300.0)
        )
        if status == 404:
            return None
        if status != 200 or not isinstance(body, dict) or body.get("success") is not True:
            raise EngineError(f"SGLang /weights_checker failed (HTTP {status}): {body!r:.200}")
        per_rank: dict[tuple[Any, ...], set[str]] = {}
        for rank in body.get("ranks") or []:
            info = rank.get("parallelism_info", {}) if isinstance(rank, dict) else {}
            key = (info.get("role"), info.get("tp_rank"), info.get("pp_rank"))
            per_rank.setdefault(key, set()).add(str(rank.get("per_gpu_checksum")))
        split = [key for key, sums in per_rank.items() if len(sums) > 1]
        if split:
            raise EngineError(f"SGLang's data-parallel engines hold different weights (ranks {split[:3]})")
        value = body.get("per_engine_checksum")
        return None if value is None else str(value)

    def reconcile(self) -> None:
        """Make SGLang serve the folder's committed version if it reports another label.

        Run once at start-up: a server launched from an older copy, or restarted while
        the folder moved on, is brought to the version the folder holds verified; the
        server's weight checksum is recorded either way.
        """
        restored = self.local.restored()
        model_path = self.local.model_path
        specs = self.local.layout()
        if restored is None or model_path is None or specs is None:
            return
        if self.engine_version() != str(restored.version):
            self.reload(model_path.resolve(), restored.version)
            self.read_back(specs, restored.fingerprints)
        self.engine_checksum = self.checksum()


def open_sglang(
    local: LocalDirTarget,
    url: str,
    *,
    mode: str = "auto",
    timeout: float = 600.0,
    spool_dir: str | Path | None = None,
) -> SGLangInPlaceTarget | SGLangTarget:
    """The SGLang adapter for ``mode``: ``inplace`` (the server must run Bulletin's loader
    without data-parallel replicas; ``ConfigError`` otherwise), ``disk``, or ``auto`` (in
    place where the server allows it, from disk otherwise). Asks the server's settings."""
    if mode not in MODES:
        raise ConfigError(f"unknown SGLang mode {mode!r} (known: {', '.join(MODES)})")
    if mode == "disk":
        return SGLangTarget(local, url, timeout=timeout, spool_dir=spool_dir)
    inplace = SGLangInPlaceTarget(local, url, timeout=timeout, spool_dir=spool_dir)
    refusal = inplace.loader_refusal()
    if refusal is None:
        return inplace
    if mode == "inplace":
        raise ConfigError(f"cannot patch SGLang in place: {refusal}")
    log.info("SGLang is served from disk: %s", refusal)
    return SGLangTarget(local, url, timeout=timeout, spool_dir=spool_dir, readback=False)
