"""Data: a day's landed documents become rows with stable ids; table schemas; the held-out split rule."""
