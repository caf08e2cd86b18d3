"""Hardware description and measurement: the `Hardware` type (datasheet presets and measured profiles)."""
