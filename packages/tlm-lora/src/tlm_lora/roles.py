"""The roles LoRA targets, by the course's module names; no torch import (a config or a flag names them)."""

from collections.abc import Iterable

#: The roles a target list may name, in the order the model runs them.
ROLES = ("q", "k", "v", "o", "w1", "w2", "w3", "lm_head")
#: The course's module name of each role (also the part names of a fused weight's split layout).
MODULE_OF_ROLE = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "output_proj",
    "w1": "w1",
    "w2": "w2",
    "w3": "w3",
    "lm_head": "lm_head",
}
ROLE_OF_MODULE = {name: role for role, name in MODULE_OF_ROLE.items()}


def check_targets(targets: str | Iterable[str]) -> tuple[str, ...]:
    """The target roles as a tuple in :data:`ROLES` order; ``"q,v"`` and ``["q", "v"]`` both work."""
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets)
    if not names or not all(isinstance(t, str) for t in names):
        raise ValueError(f"targets must name at least one of {list(ROLES)}, got {targets!r}")
    if unknown := [t for t in names if t not in ROLES]:
        raise ValueError(f"targets: unknown roles {unknown}; the roles are {list(ROLES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"targets names a role twice: {names}")
    return tuple(r for r in ROLES if r in names)
