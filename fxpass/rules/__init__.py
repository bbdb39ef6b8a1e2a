"""The rules memopt runs, in order. CCE first: it claims the classifier linear, which WTA-CRS must not take."""

from fxpass.rules import cce, wta_crs
from fxpass.rules.base import Decision, Rule

RULES: tuple[Rule, ...] = (cce.RULE, wta_crs.RULE)

__all__ = ["RULES", "Decision", "Rule"]
