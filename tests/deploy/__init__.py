"""Tests of the deployment artifacts under deploy/ and docs/operations.md."""
