"""Run segment attempts as Slurm jobs (launcher: commands; Slurm's own output: commands)."""
