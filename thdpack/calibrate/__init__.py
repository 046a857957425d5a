"""``thdpack calibrate``: measure this machine and write its ``thdpack.perf`` profile.

``thdpack.perf`` models a step from a machine's constants and stays torch-free, so a planner can
import it anywhere. Measuring needs torch (kernels, process groups), so it lives here, beside it:
``kernels`` times one rank's device and host, ``links`` the sends and collectives between ranks,
``command`` runs both on every rank and writes the profile (``MachineProfile.to_json``).
"""
