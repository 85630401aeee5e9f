"""Shared test code (imported by tests, never collected): references, workers, data builders."""
