from tokenyard.cli import main

main()
