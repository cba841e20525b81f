"""A small real engine for the demo: paged-attention transformer, scheduler, P/D pair."""
