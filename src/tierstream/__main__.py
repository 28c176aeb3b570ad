from tierstream.cli import main

main()
