"""The built-in scheduler loop and adapters that act on real schedulers."""

from gpuvigil.scheduler.core import Action, JobSpec, NodeSpec, Scheduler, SchedulerStateCollector

__all__ = ["Action", "JobSpec", "NodeSpec", "Scheduler", "SchedulerStateCollector"]
