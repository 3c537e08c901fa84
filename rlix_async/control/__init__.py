"""Control plane: topology, planner, scheduler loop, registry, journal, coordinator."""
