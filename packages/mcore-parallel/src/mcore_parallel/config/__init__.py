"""Configuration dataclasses and the generator that turns their field metadata into a CLI."""
