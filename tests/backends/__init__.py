"""Contract tests of the vendor backends against recorded fakes of their vendor modules."""
