"""Tools built on the library: explain, parity measurement and the demo."""
