"""Verification: files, static checks, parity against golden outputs, speech, reports."""
