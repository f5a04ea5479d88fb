"""The driver: runs on node 0 once the Ray cluster has formed (launcher.driver.jobs: the job kinds;
launcher.driver.grpo: the GRPO loop). Empty on purpose: see launcher.driver.jobs."""
