"""Context parallelism (CP) of the backbone: the rules every system's layout checks, and the
choices its layout search tries. The cost of CP is bench.sim.context's.

Patterns (`cp_comm`):
  a2a   DeepSpeed-Ulysses: all-to-all over heads; each rank attends over the whole sequence for
        heads / cp of the heads, so TP x CP must divide the heads and the KV groups. Runs on
        CPU / gloo (../shared/notes/context-parallel-on-cpu.md): the measured pattern.
  ring  ring attention: K/V blocks passed around the ring, each rank keeping 2 of 2 cp zig-zag
        chunks of the sequence (Megatron-LM / Transformer Engine load balancing), so 2 cp must
        divide the sequence. Simulated only (torch's ring attention has no CPU sharding rule,
        megatron-core's needs Transformer Engine).
With sequence parallelism each CP rank's tokens are split over TP as well.
"""
from __future__ import annotations

PATTERNS = ("a2a", "ring")
MEASURED_PATTERNS = ("a2a",)
RING_MEASURED = ("cp_comm=ring is simulated only; measured runs use cp_comm=a2a (DeepSpeed Ulysses, "
                 "runs on CPU/gloo)")


def rule(w, tp: int, cp: int, pattern: str, sp: bool = False) -> str | None:
    """Why the backbone of workload `w` cannot run CP `cp` with `pattern` at TP `tp` (one line
    saying how to fix it), or None if it can."""
    b = w.backbone
    if pattern not in PATTERNS:
        return f"cp_comm={pattern!r}; choose one of {list(PATTERNS)}"
    if cp < 1:
        return f"cp={cp} must be >= 1"
    if cp == 1:
        return None
    if pattern == "a2a" and (b.num_attention_heads % (tp * cp) or b.num_query_groups % (tp * cp)):
        return (f"cp={cp} with cp_comm=a2a (Ulysses shards heads): tp x cp = {tp * cp} must divide the backbone's "
                f"{b.num_attention_heads} heads and {b.num_query_groups} query groups; lower cp or use cp_comm=ring")
    unit = cp * (2 if pattern == "ring" else 1) * (tp if sp else 1)
    if b.seq_length % unit:
        what = ("2 x cp (zig-zag chunks)" if pattern == "ring" else "cp") + (" x tp (sp)" if sp else "")
        return f"cp={cp}: {what} = {unit} does not divide the backbone's sequence length {b.seq_length}; lower cp"
    return None


def choices(w, tp: int, max_cp: int, sp: bool = False, patterns=PATTERNS) -> list[tuple[int, str]]:
    """(cp, pattern) pairs a layout search tries: (1, "a2a") (no CP) and every power of two
    2 <= cp <= max_cp with each pattern the rules admit."""
    out, c = [(1, "a2a")], 2
    while c <= max_cp:
        out += [(c, p) for p in patterns if rule(w, tp, c, p, sp) is None]
        c *= 2
    return out
