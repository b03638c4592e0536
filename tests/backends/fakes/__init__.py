"""Recorded fakes of vendor device modules (see fake_device_module.py for the generic one)."""
