"""The plan: per-table kind, backend, optimizer spec and sharding, from the config."""

from dynarec.planner.plan import Plan, PlanError, TablePlan, plan_from_config, plan_tables
from dynarec.planner.sharding import TableSharding, key_owner

__all__ = ["Plan", "PlanError", "TablePlan", "TableSharding", "key_owner", "plan_from_config", "plan_tables"]
