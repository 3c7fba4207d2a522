"""The plan: per-table kind, backend and optimizer spec, from the config."""

from dynarec.planner.plan import Plan, TablePlan, plan_from_config

__all__ = ["Plan", "TablePlan", "plan_from_config"]
