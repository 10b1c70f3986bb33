"""Model families; :mod:`tianxia.models.registry` maps architecture names to classes."""
