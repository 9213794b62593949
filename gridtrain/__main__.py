from gridtrain.cli import main

main()
