"""ignis.backends: the speculation backends (off, mtp, dflash2), their protocol, and the entry-point registry."""
