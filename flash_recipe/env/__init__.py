"""Facts about the machine (probes), upstream wheel naming, and the doctor's rules."""
