"""lightfleet's tests: a package, so that every test module has a name of its own and the tests import
their shared code as tests.helpers.* (tests/helpers/)."""
