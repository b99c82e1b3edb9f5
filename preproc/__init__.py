"""Criteo preprocessing on Apache Spark: raw TSV logs -> split-binary dataset (docs/preprocessing.md)."""
