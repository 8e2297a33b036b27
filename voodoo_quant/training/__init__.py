"""Gate training: config, trainer, journal, bake."""
