"""Expert parallelism applied from outside: slicing a plain model's experts (`expert_parallel`) and
the all-to-all token dispatcher over the EP group (`all_to_all`)."""
