"""Tests of the CPU reference engine (``mmgate.refengine``)."""
