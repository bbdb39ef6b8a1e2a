"""The rules memopt runs, in order. CCE first: it claims the classifier linear, which WTA-CRS must not take;
attention before WTA-CRS, whose liveness analysis must see what the attention op saves; the embedding rule
changes only the backward of a table, so its place is free."""

from fxpass.rules import attention, cce, embedding, wta_crs
from fxpass.rules.base import Decision, Rule

RULES: tuple[Rule, ...] = (cce.RULE, attention.RULE, wta_crs.RULE, embedding.RULE)

__all__ = ["RULES", "Decision", "Rule"]
