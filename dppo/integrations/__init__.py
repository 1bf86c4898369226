"""Adapters that carry dppo's losses into other trainers (TRL: `dppo.integrations.trl`); each imports its framework itself."""
