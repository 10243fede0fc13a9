"""One case of the Hugging Face sweep: a tiny decoder under ``attn_implementation="cp"``.

:func:`sweep_case` runs on every rank of a :class:`~cp_core.testing.multirank.RankPool`: it
shards a packed batch (documents by restarting ``position_ids``, trailing pad), runs one
training step of a :func:`~cp_core.testing.hf_models.tiny_model` inside the sharder's context,
sums the gradients over the CP group and reports what happened on this rank: ``ran`` (rank 0
adds the loss, the gradients and the per-token losses in the caller's ``[B, S]``),
``refused`` (a library error, :class:`~cp_core.errors.CPError`) or ``crashed`` (anything
else). :func:`classify` turns every rank's report and the truth into one outcome:

* ``match``: loss and token losses within ``1e-5``, every gradient within ``1e-4``;
* ``match*``: loss and token losses within ``1e-5``, gradients beyond ``1e-4`` but within twice
  the spread between transformers' own sdpa and eager runs of the same documents (a tiny
  config whose fp32 gradients no implementation pins down to ``1e-4``);
* ``refused``: every rank raised a library error (``named`` says whether it names the
  row's feature, :data:`~cp_core.testing.hf_models.REFUSED_FEATURE`);
* ``MISMATCH``: it ran and disagrees with the truth (silently wrong);
* ``CRASH``: some rank raised something that is not a library error;
* ``HANG``: some rank waited in a collective until the group's timeout (another rank failed);
* ``unbuilt`` / ``no truth``: transformers could not build the tiny model with ``"cp"`` (a
  loud refusal of its own) or could not run it in eager mode; nothing about CP is known.
"""

from __future__ import annotations

import traceback
from typing import Any, Sequence

import torch

from cp_core.testing.hf_models import REFUSED_FEATURE, cached_truth, compare, \
    gathered_token_loss, tiny_model, weights_digest

#: The sweep's batch: row 0 is full, row 1 ends in 14 pad tokens; every document but the
#: shortest is longer than the rows' windows (5-7) and Llama 4's chunk (8).
DOCS: list[list[int]] = [[9, 14, 20, 18, 6], [30, 17, 6]]
SEQ = 67
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
_TIMEOUT_WORDS = ("timed out", "timeout", "Timeout", "CPRankFailedError", "Connection closed",
                  "Connection reset")


def sweep_case(rank: int, world: int, arch: str, backend: str, size: int,
               config: dict[str, Any] | None = None, docs: Sequence[Sequence[int]] = DOCS,
               seq: int = SEQ) -> dict[str, Any] | None:
    """One training step of ``arch`` under ``backend`` at cp ``size`` on this rank (ranks at
    or above ``size`` return None); never raises."""
    from cp_core.testing.multirank import leading_group

    group = leading_group(size)
    if group is None:
        return None
    try:
        return _step(rank, group, arch, backend, size, config or {}, docs, seq)
    except Exception as exc:  # reported, not raised: the sweep classifies it
        from cp_core.errors import CPError

        status = "refused" if isinstance(exc, CPError) else "crashed"
        text = f"{type(exc).__name__}: {exc}" if status == "refused" else \
            traceback.format_exc(limit=6)
        return {"status": status, "error": text}


def _step(rank: int, group: Any, arch: str, backend: str, size: int, config: dict[str, Any],
          docs: Sequence[Sequence[int]], seq: int) -> dict[str, Any]:
    import cp_core.hf  # registers "cp"
    from cp_core.datasets import make_packed_batch
    from cp_core.grads import allreduce_gradients
    from cp_core.loss import cp_cross_entropy
    from cp_core.registry import build_sharder

    batch = make_packed_batch([list(d) for d in docs], vocab=64, seed=5, pad_to=seq)
    batch.pop("_packed_seq_ids")  # documents come from the restarting position_ids alone
    try:
        model = tiny_model(arch, "cp")
    except Exception as exc:  # transformers refuses the config or "cp" for this model
        return {"status": "unbuilt", "error": f"{type(exc).__name__}: {exc}"}
    sharder = build_sharder({"backend": backend, "size": size, **config}, group)
    ctx, local = sharder.shard(batch)
    with ctx():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                       use_cache=False).logits
        loss = cp_cross_entropy(logits, local["labels"], group)
        loss.backward()
    for p in model.parameters():  # an expert no local token chose has no gradient here
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    allreduce_gradients(model, group)
    token_loss = gathered_token_loss(sharder, logits, local["labels"])
    if rank:
        return {"status": "ran"}
    return {"status": "ran", "loss": float(loss.detach()), "token_loss": token_loss,
            "grads": {n: p.grad for n, p in model.named_parameters()},
            "weights": weights_digest(model)}


def _fp32_spread(arch: str, docs: Sequence[Sequence[int]], seq: int) -> float | None:
    """The worst gradient difference between transformers' own sdpa and eager runs of the
    documents (no project code): how precisely fp32 can pin this tiny model's gradients down
    (None when the model has no sdpa path)."""
    try:
        eager = cached_truth(arch, docs, seq)
        return compare(eager, cached_truth(arch, docs, seq, impl="sdpa"))["grad"]
    except Exception:
        return None


def classify(arch: str, reports: Sequence[dict[str, Any] | None],
             docs: Sequence[Sequence[int]] = DOCS, seq: int = SEQ) -> dict[str, Any]:
    """One outcome of every rank's :func:`sweep_case` report against the truth (see the
    module docstring): ``{"outcome", "detail", "errors"?, "named"?}``."""
    ranks = [r for r in reports if r is not None]
    statuses = {r["status"] for r in ranks}
    if statuses == {"ran"}:
        try:
            truth = cached_truth(arch, docs, seq)
        except Exception as exc:  # the eager model itself fails: nothing to compare with
            return {"outcome": "no truth", "detail": f"{type(exc).__name__}: {exc}"[:300]}
        got = ranks[0]
        if abs(got["weights"] - truth["weights"]) > 1e-9 * max(1.0, abs(truth["weights"])):
            return {"outcome": "CRASH", "detail": "the truth's weights differ from the run's"}
        errors = compare(truth, got)
        ok = errors["loss"] <= LOSS_TOL and errors["tokens"] <= LOSS_TOL and \
            errors["grad"] <= GRAD_TOL
        detail = f"loss {errors['loss']:.1e} grad {errors['grad']:.1e}"
        if ok:
            return {"outcome": "match", "detail": detail, "errors": errors}
        spread = _fp32_spread(arch, docs, seq)
        if spread is not None and errors["loss"] <= LOSS_TOL and errors["tokens"] <= LOSS_TOL \
                and errors["grad"] <= 2 * spread:
            return {"outcome": "match*", "errors": errors,
                    "detail": f"{detail}: within 2x the gradient spread of transformers' own "
                              f"sdpa vs eager ({spread:.1e})"}
        return {"outcome": "MISMATCH", "detail": detail, "errors": errors}
    texts = [r.get("error", "") for r in ranks if r["status"] != "ran"]
    if statuses == {"unbuilt"}:
        return {"outcome": "unbuilt", "detail": texts[0].splitlines()[0][:300]}
    if statuses == {"refused"}:
        feature = REFUSED_FEATURE.get(arch.split("@")[0])
        message = texts[0].splitlines()[0] if texts else ""
        named = feature is None or feature.lower() in " ".join(texts).lower()
        return {"outcome": "refused", "detail": message[:300], "named": named}
    waited = any(any(w in t for w in _TIMEOUT_WORDS) for t in texts)
    detail = " | ".join(t.strip().splitlines()[-1] for t in texts if t)[:300]
    if not waited:
        try:  # does the model run at all, without CP?
            cached_truth(arch, docs, seq)
        except Exception as exc:
            return {"outcome": "no truth", "detail": f"{type(exc).__name__}: {exc}"[:300]}
    return {"outcome": "HANG" if waited else "CRASH", "detail": detail}


__all__ = ["DOCS", "GRAD_TOL", "LOSS_TOL", "SEQ", "classify", "sweep_case"]
