"""What the tests share; test modules import it as `tests.helpers.<module>`, and never each other
(tests/test_suite_shape.py).

- probe: callbacks the tests put into real runs by name (`+callbacks.x._target_=tests.helpers.probe.Effects`),
  and what in-process tests share about models (knobs_of, attention_in_plain_matmuls, ...).
- strategies: every strategy's declared test data (wiring cases, row settings, row effect).
- commands: the environment of every process the tests start (the project's root on PYTHONPATH).
- distributed: 2-process torch runs and their rank side; optimizer_checks: LARS's and LAMB's shared checks.
- data_files: files the tests train on; paddle_reference: Paddle's scripts (tests/paddle/) as the reference.
- resume: the check that a resume is exact; preemption: the command as a process a test signals;
  user_code: a user's model, written with nothing of lightfleet's, and packages of theirs named as lightfleet's.
- selections: how many tests a pytest selection selects (the mutants' of tests/mutations.py).
"""
