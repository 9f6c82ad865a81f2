"""Scheduling policies (`--schedule-policy`)."""

from srv.sdk import hookimpl

SRV_SDK_VERSION = ">=0.1,<0.2"

POLICIES = "srv.plugins.scheduling.policies"


@hookimpl
def srv_register_schedule_policies(register):
    register("fcfs", f"{POLICIES}:FCFSPolicy", description="first come, first served", priority=10)
    register("lpm", f"{POLICIES}:LongestPrefixMatchPolicy",
             description="longest cached prefix first (best prefix-cache reuse)")
    register("dfs-weight", f"{POLICIES}:DFSWeightPolicy",
             description="depth-first over the prefix tree, heaviest subtree first (keeps shared prefixes hot)")
    register("lof", f"{POLICIES}:LongestOutputFirstPolicy", description="largest max_new_tokens first")
    register("random", f"{POLICIES}:RandomPolicy", description="random order (seeded by --random-seed)")
    register("priority", f"{POLICIES}:PriorityPolicy",
             description="by request priority (see --schedule-low-priority-values-first)")
