"""The built-in environments of multi-turn episodes (env.fn; launcher.driver.environments)."""
