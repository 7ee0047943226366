"""Tests of the adapters to other standards (distrl.standards), with the standards' real packages."""
