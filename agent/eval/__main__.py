"""`python -m agent.eval`: run the evaluation and print the table."""

from agent.eval.runner import main

if __name__ == "__main__":
    main()
