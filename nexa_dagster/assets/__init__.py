"""The Nexa lifecycle as software-defined assets, one module per stage."""
